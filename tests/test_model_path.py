"""engine/loader/model_path.py: a hub id missing from the local cache is downloaded, or the error
says why it cannot be (offline mode, a Hub out of reach, no such model). No network: the Hub is
huggingface_hub's snapshot_download, replaced by a fake."""
import shutil

import httpx2
import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from engine.loader import model_path
from engine.loader.model_path import HUB_ALLOW_PATTERNS, resolve_model_path

REPO = "tiny-org/tiny-llama"


class FakeHub:
    """snapshot_download: nothing in the cache; a download copies `checkpoint`, or raises `error`."""

    def __init__(self, cache, checkpoint=None, error=None):
        self.cache, self.checkpoint, self.error = cache, checkpoint, error
        self.downloads: list[dict] = []

    def __call__(self, repo_id, local_files_only=False, **kw):
        validate_repo_id(repo_id)  # as snapshot_download: HFValidationError for what is no hub id
        if local_files_only:
            raise LocalEntryNotFoundError(f"{repo_id} is not in the cache")
        self.downloads.append({"repo_id": repo_id, **kw})
        if self.error is not None:
            raise self.error
        target = self.cache / repo_id.replace("/", "--")
        shutil.copytree(self.checkpoint, target)
        return str(target)


@pytest.fixture
def online(monkeypatch):
    """Offline mode off, whatever this machine's environment says."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def _hub(monkeypatch, tmp_path, **kw) -> FakeHub:
    hub = FakeHub(tmp_path, **kw)
    monkeypatch.setattr(model_path, "snapshot_download", hub)
    return hub


def test_a_reachable_hub_downloads_what_the_cache_lacks(online, monkeypatch, tmp_path, tiny_llama):
    hub = _hub(monkeypatch, tmp_path, checkpoint=tiny_llama)
    path = resolve_model_path(REPO)
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    (download,) = hub.downloads
    assert download["repo_id"] == REPO and download["allow_patterns"] == HUB_ALLOW_PATTERNS  # safetensors only


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_says_so_and_downloads_nothing(online, monkeypatch, tmp_path, tiny_llama, variable):
    hub = _hub(monkeypatch, tmp_path, checkpoint=tiny_llama)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ValueError, match=f"'{REPO}' is not a local directory and not in the Hugging Face cache"
                                         ".*HF_HUB_OFFLINE is set, so this machine cannot download it"):
        resolve_model_path(REPO)
    assert not hub.downloads


@pytest.mark.parametrize("error", [
    LocalEntryNotFoundError("cannot reach the Hub and the file is not cached"),  # how a failed connection ends
    httpx2.ConnectTimeout("timed out"),
], ids=["no_connection", "timeout"])
def test_an_unreachable_hub_says_so(online, monkeypatch, tmp_path, error):
    _hub(monkeypatch, tmp_path, error=error)
    with pytest.raises(ValueError, match=f"'{REPO}' is not a local directory.*the Hugging Face Hub is not reachable "
                                         f"from this machine, so it cannot download it \\({type(error).__name__}\\)"):
        resolve_model_path(REPO)


def test_a_model_the_hub_does_not_have_says_so(online, monkeypatch, tmp_path):
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    _hub(monkeypatch, tmp_path, error=RepositoryNotFoundError("404 Repository Not Found", response=response))
    with pytest.raises(ValueError, match="the Hugging Face Hub has no such model.*cannot download it "
                                         r"\(RepositoryNotFoundError\).*hf auth login"):
        resolve_model_path(REPO)


def test_a_missing_path_is_not_sent_to_the_hub(online, monkeypatch, tmp_path):
    hub = _hub(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="'/no/such/dir' is not a local directory.*nor a Hub id"):
        resolve_model_path("/no/such/dir")
    assert not hub.downloads

"""The checks behind tests/test_deploy_manifests.py: deploy/rayservice.yaml against the KubeRay
CRD (strict), its serveConfigV2 against Ray Serve's schema and our args parser, and what no
schema sees (agreement with deploy/config.yaml, GPU sizing, the frontend on the head)."""
from __future__ import annotations

import copy
import functools
import importlib
import json
import re
import typing
from pathlib import Path

import jsonschema
import ray
import yaml
from pydantic import BaseModel, ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import deployment_names
from serve_app.args import parse_app_args
from serve_app.replica.placement import engine_placement

ROOT = Path(__file__).resolve().parents[1]
RAYSERVICE = ROOT / "deploy" / "rayservice.yaml"
SERVE_CONFIG = ROOT / "deploy" / "config.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
RAYJOB = ROOT / "deploy" / "rayjob.yaml"
_FIXTURES = Path(__file__).resolve().parent / "fixtures"
CRDS = {"RayService": _FIXTURES / "ray.io_rayservices.yaml", "RayJob": _FIXTURES / "ray.io_rayjobs.yaml"}


# -- YAML: duplicate keys are an error (PyYAML would keep the last one silently) --------------
class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str):
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


# -- layer 1: the CRD schema ------------------------------------------------------------------
def strict_schema(node):
    """A copy of an openAPIV3Schema node that jsonschema reads as the API server would, strictly."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":  # names -> schemas (a property may be called "items" or "type")
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = strict_schema(value)
        else:
            out[key] = value
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -2**31 <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -2**63 <= value < 2**63


@functools.lru_cache(maxsize=None)
def _crd(kind: str) -> dict:
    if kind not in CRDS:
        raise ValueError(f"kind {kind!r}: no CRD fixture (have {sorted(CRDS)})")
    return yaml.load(CRDS[kind].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = _crd(kind)
    group, _, version = api_version.partition("/")
    if (group, kind) != (crd["spec"]["group"], crd["spec"]["names"]["kind"]):
        raise ValueError(f"{api_version} {kind} is not the CRD's {crd['spec']['group']} {crd['spec']['names']['kind']}")
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        raise ValueError(f"apiVersion {api_version}: the CRD serves {sorted(served)}")
    return jsonschema.Draft7Validator(strict_schema(served[version]["schema"]["openAPIV3Schema"]),
                                      format_checker=_FORMATS)


def crd_errors(manifest: dict) -> list[str]:
    validator = crd_validator(manifest.get("apiVersion", ""), manifest.get("kind", ""))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))]
    name = manifest.get("metadata", {}).get("name", "")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):  # ObjectMeta: not in the CRD schema
        errors.append(f"metadata.name={name!r}: not a DNS-1035 label")
    return errors


# -- layer 2: the Serve config inside it ------------------------------------------------------
def _submodel(annotation) -> type[BaseModel] | None:
    """The pydantic model in `Model`, `Optional[Model]`, `List[Model]`, `Union[Dict, Model]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (model := _submodel(arg)) is not None:
            return model
    return None


def unknown_keys(raw, model: type[BaseModel], path: str) -> list[str]:
    """Keys Ray Serve's schema would ignore without a word (its models allow extra keys)."""
    if not isinstance(raw, dict):
        return []
    fields = model.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    errors = [] if model.model_config.get("extra") == "allow" else \
        [f"{path}.{key}: unknown field of {model.__name__}" for key in raw if key not in known]
    for name, field in fields.items():
        sub, value = _submodel(field.annotation), raw.get(name)
        if sub is None or value is None:
            continue
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            errors += unknown_keys(item, sub, f"{path}.{name}" + ("" if i is None else f"[{i}]"))
    return errors


def serve_config(manifest: dict) -> dict:
    return load_yaml(manifest["spec"]["serveConfigV2"])


def serve_config_errors(manifest: dict) -> list[str]:
    try:
        config = serve_config(manifest)
        ServeDeploySchema.model_validate(config)
    except (yaml.YAMLError, ValidationError) as e:
        return [f"serveConfigV2: {e}"]
    errors = unknown_keys(config, ServeDeploySchema, "serveConfigV2")
    for app in config["applications"]:
        where = f"serveConfigV2.applications[{app.get('name')}]"
        module, _, attr = app["import_path"].replace(":", ".").rpartition(".")
        try:  # the image imports it the same way (our package installed, no working_dir)
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            errors.append(f"{where}.import_path={app['import_path']!r}: {e}")
        try:
            parse_app_args(app.get("args"))  # what build_app runs first
        except ValueError as e:
            errors.append(f"{where}.args: {e}")
    return errors


# -- layer 3: consistency ---------------------------------------------------------------------
def _app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def _deployments(app: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app.get("deployments", [])}


def agreement_errors(rayservice_app: dict, local_app: dict) -> list[str]:
    errors = [f"{key}: {rayservice_app.get(key)!r} here, {local_app.get(key)!r} in deploy/config.yaml"
              for key in ("name", "import_path", "route_prefix") if rayservice_app.get(key) != local_app.get(key)]
    # The deployments build_app binds for each app's args: an entry under another name would not
    # configure them (the CPU demo runs colocate_ingress, one deployment; the RayService three).
    for which, app in (("rayservice", rayservice_app), ("config.yaml", local_app)):
        try:
            bound = deployment_names(parse_app_args(app.get("args")))
        except ValueError as e:
            errors.append(f"{which} args: {e}")
            continue
        if set(_deployments(app)) != bound:
            errors.append(f"{which} deployments {sorted(_deployments(app))} != build_app's {sorted(bound)}")
    return errors


def _containers(manifest: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod spec, ray container) of the head and each worker group."""
    cluster = _cluster(manifest)
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    return [(name, g["template"]["spec"], g["template"]["spec"]["containers"][0]) for name, g in groups]


def _cluster(manifest: dict) -> dict:
    """The RayCluster spec: a RayService's rayClusterConfig, a RayJob's rayClusterSpec."""
    spec = manifest["spec"]
    return spec["rayClusterConfig"] if "rayClusterConfig" in spec else spec["rayClusterSpec"]


def _quantity(value) -> float:
    value = str(value)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def _custom_resources(rayStartParams: dict) -> dict:
    raw = rayStartParams.get("resources")  # KubeRay's format: '"{\"name\": 1}"'
    return json.loads(raw.strip('"').replace('\\"', '"')) if raw else {}


def consistency_errors(manifest: dict) -> list[str]:
    app = _app(serve_config(manifest))
    args = parse_app_args(app["args"])
    errors = []
    if (args.device, args.dtype) != ("cuda", "bfloat16"):
        errors.append(f"device/dtype {args.device}/{args.dtype}: a GPU cluster wants cuda/bfloat16")
    cluster = manifest["spec"]["rayClusterConfig"]
    head, *workers = _containers(manifest)
    if "nvidia.com/gpu" in head[2].get("resources", {}).get("limits", {}):
        errors.append("the head asks for GPUs; it runs the proxy, Ingress and Guardrails only")
    # Each GPU pod holds whole engine replicas: tensor_parallel_size GPUs (+ CPUs) in one bundle set.
    bundles = engine_placement("cuda", args.tensor_parallel_size, args.engine_num_cpus)["placement_group_bundles"]
    need_gpus, need_cpus = sum(b.get("GPU", 0) for b in bundles), sum(b.get("CPU", 0) for b in bundles)
    gpu_groups = [g for g in cluster.get("workerGroupSpecs", [])
                  if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"].get("limits", {})]
    if not gpu_groups:
        errors.append("no worker group asks for nvidia.com/gpu")
    for group in gpu_groups:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus, cpus = int(_quantity(limits["nvidia.com/gpu"])), _quantity(limits.get("cpu", 0))
        if gpus != need_gpus or cpus < need_cpus:
            errors.append(f"{group['groupName']}: {gpus} GPUs / {cpus} CPUs per pod, one engine replica "
                          f"(tensor_parallel_size={args.tensor_parallel_size}) takes {need_gpus} / {need_cpus}")
        if (group["minReplicas"], group["maxReplicas"]) != (args.min_replicas, args.max_replicas):
            errors.append(f"{group['groupName']}: pods {group['minReplicas']}..{group['maxReplicas']} != engine "
                          f"replicas {args.min_replicas}..{args.max_replicas}")
    # The frontend deployments ask for a resource that only the head offers.
    head_resources = _custom_resources(cluster["headGroupSpec"].get("rayStartParams", {}))
    for name in ("Ingress", "Guardrails"):
        wants = _deployments(app)[name].get("ray_actor_options", {}).get("resources", {})
        if not wants or not set(wants) <= set(head_resources):
            errors.append(f"{name} asks for {wants}, the head offers {head_resources}")
    # The model comes from a volume mounted on every pod (the head loads the tokenizer).
    for group, pod, container in _containers(manifest):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        path = args.model if args.model.startswith("/") else env.get("HF_HOME", "")
        mounts = [m for m in container.get("volumeMounts", [])
                  if path.startswith(m["mountPath"].rstrip("/") + "/")
                  and "persistentVolumeClaim" in volumes.get(m["name"], {})]
        if not mounts:
            errors.append(f"{group}: {path!r} (the model) is on no mounted PersistentVolumeClaim")
        if env.get("HF_HUB_OFFLINE") != "1":
            errors.append(f"{group}: HF_HUB_OFFLINE is not '1' (pods must not download the model)")
    return errors


def with_serve_config(manifest: dict, change) -> dict:
    """A copy of the manifest whose serveConfigV2 went through `change(config)`."""
    bad = copy.deepcopy(manifest)
    config = serve_config(bad)
    change(config)
    bad["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    return bad


# -- the RayJob (deploy/rayjob.yaml): a batch job, python -m serve_app.batch ------------------
def rayjob_args(manifest: dict):
    """The entrypoint's arguments through the batch CLI's own parser (ValueError if it refuses)."""
    import shlex

    from serve_app.batch.__main__ import parse_args
    argv = shlex.split(manifest["spec"]["entrypoint"])
    if argv[:3] != ["python", "-m", "serve_app.batch"]:
        raise ValueError(f"entrypoint runs {argv[:3]}, not python -m serve_app.batch")
    try:
        return parse_args(argv[3:])
    except SystemExit:  # argparse printed why on stderr
        raise ValueError(f"the batch CLI refuses the entrypoint's arguments {argv[3:]}") from None


def rayjob_errors(manifest: dict) -> list[str]:
    """What the CRD does not see: CLI arguments, GPUs per pod, replicas, volumes, resume."""
    try:
        args = rayjob_args(manifest)
    except ValueError as e:
        return [str(e)]
    errors = [] if args.resume else ["--resume missing: a retried job (backoffLimit) would refuse the output"]
    if args.device != "cuda":
        errors.append(f"--device {args.device}: a GPU cluster wants cuda")
    head, *workers = _containers(manifest)
    gpu_groups = [g for g in _cluster(manifest).get("workerGroupSpecs", [])
                  if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"].get("limits", {})]
    for group in gpu_groups:
        gpus = int(_quantity(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]))
        if gpus != args.tensor_parallel_size:
            errors.append(f"{group['groupName']}: {gpus} GPUs per pod, an engine actor "
                          f"(--tensor-parallel-size) takes {args.tensor_parallel_size}")
    pods = sum(g["replicas"] for g in gpu_groups)
    if pods != args.num_replicas:
        errors.append(f"--num-replicas {args.num_replicas} != {pods} GPU pods")
    paths = {"the model": (args.model, False), "the input": (args.input, False), "the output": (args.output, True),
             "the template": (args.template, False), "the response format": (args.response_format, False)}
    for group, pod, container in _containers(manifest):
        for what, (path, write) in paths.items():
            if path and "://" not in path and not _on_volume(pod, container, path, write):
                errors.append(f"{group}: {path!r} ({what}) is on no {'writable ' if write else ''}mounted "
                              f"PersistentVolumeClaim")
    return errors


def _on_volume(pod: dict, container: dict, path: str, write: bool) -> bool:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return any(path.startswith(m["mountPath"].rstrip("/") + "/")
               and "persistentVolumeClaim" in volumes.get(m["name"], {})
               and not (write and (m.get("readOnly") or volumes[m["name"]]["persistentVolumeClaim"].get("readOnly")))
               for m in container.get("volumeMounts", []))

"""Mixture-of-experts: the router (`ReplicatedLinear`, `select_experts`) and the experts (`FusedMoE`)."""
from engine.layers.fused_moe.layer import FusedMoE
from engine.layers.fused_moe.routing import ReplicatedLinear, select_experts

__all__ = ["FusedMoE", "ReplicatedLinear", "select_experts"]

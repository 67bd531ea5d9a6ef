"""A kustomization built the way ``kubectl kustomize`` builds the features deploy/k8s uses
(resources, labels, JSON 6902 patches, images), for tests that run where no kubectl is; a
kustomization with any other field is refused rather than half-built."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

_FIELDS = {"apiVersion", "kind", "labels", "resources", "patches", "images"}


def build(directory: Path) -> list[dict[str, Any]]:
    """Every object of the kustomization in ``directory``, in order."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _FIELDS
    assert not unknown, f"{directory}: this builder does not know {sorted(unknown)}"
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [o for o in objects if _matches(o, target)]
        assert matches, f"{directory}: a patch's target {target} matches nothing"
        for obj in matches:
            for op in yaml.safe_load(patch["patch"]):
                _apply(obj, op)
    for pair in kustomization.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(pair["pairs"])
    for image in kustomization.get("images", []):
        for container in containers(objects):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                new_tag = image.get("newTag", tag)
                container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")
    return objects


def containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The containers of every workload (Deployment, StatefulSet) among ``objects``."""
    pods = [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]
    return [c for pod in pods for c in pod["containers"]]


def _matches(obj: dict[str, Any], target: dict[str, str]) -> bool:
    return obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]


def _apply(obj: dict[str, Any], op: dict[str, Any]) -> None:
    """One JSON patch operation (RFC 6902: add, replace, remove) on ``obj``."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) and last != "-" else last
    kind = op["op"]
    if kind == "remove" or kind == "replace":
        assert (key < len(node)) if isinstance(node, list) else (key in node), op["path"]
    if kind == "remove":
        del node[key]
    elif kind == "replace":
        node[key] = copy.deepcopy(op["value"])
    elif kind == "add" and isinstance(node, list):
        node.insert(len(node) if key == "-" else key, copy.deepcopy(op["value"]))
    elif kind == "add":
        node[key] = copy.deepcopy(op["value"])
    else:
        raise AssertionError(f"unsupported patch operation {kind}")

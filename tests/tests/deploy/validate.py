"""Validates Kubernetes manifests as kubectl reads them (YAML 1.1, here PyYAML).

Built-in kinds go to kubernetes-validate's bundled schemas (strict: unknown
fields are errors); custom resources to the CRD schemas in --schemas (files
named <group>_<version>_<kind in lower case>.json), closed to unknown fields
unless the schema says x-kubernetes-preserve-unknown-fields. A kind with no
schema at all is an error, so nothing passes unvalidated.

Usage: validate.py --k8s 1.30.0 --schemas DIR FILE...
Prints one JSON object per document: {"file", "index", "kind", "name", "ok", "error"};
exits 0 when every document is valid, 1 otherwise, 2 on bad usage.
"""
import argparse
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml


class Loader(yaml.SafeLoader):
    """Timestamps stay strings, as they are in the Kubernetes API."""


Loader.add_constructor("tag:yaml.org,2002:timestamp", Loader.construct_yaml_str)


def closed(schema):
    """The schema with every object that lists its properties closed to others."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_validator(schemas, api_version, kind):
    group, _, version = api_version.rpartition("/")
    path = os.path.join(schemas, f"{group}_{version}_{kind.lower()}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return jsonschema.Draft7Validator(closed(json.load(f)))


def check(doc, args):
    api_version, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    validator = crd_validator(args.schemas, api_version, kind)
    if validator is not None:
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            return f"{'.'.join(str(p) for p in e.path)}: {e.message}"
        return None
    try:
        kubernetes_validate.validate(doc, args.k8s, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return f"no schema for {api_version} {kind} (Kubernetes {args.k8s}, or in {args.schemas})"
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(str(p) for p in e.path)}: {e.message}"
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k8s", required=True)
    p.add_argument("--schemas", required=True)
    p.add_argument("files", nargs="+")
    args = p.parse_args()
    all_ok = True
    for path in args.files:
        with open(path) as f:
            docs = [d for d in yaml.load_all(f, Loader=Loader) if d is not None]
        for i, doc in enumerate(docs):
            meta = doc.get("metadata") or {}
            error = check(doc, args)
            all_ok &= error is None
            print(json.dumps({"file": path, "index": i, "kind": doc.get("kind"),
                              "name": meta.get("name"), "ok": error is None, "error": error}))
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()

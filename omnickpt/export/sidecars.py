"""The files a Hugging Face folder keeps beside its weights, carried into an export from a source folder
that has them (an HF Trainer `checkpoint-N/` folder saved by omnickpt holds the model's config.json,
generation_config.json and tokenizer beside the omnickpt checkpoint), so that the export loads with
`from_pretrained` as it is. Local sources only; files the export writes itself are never overwritten."""
from __future__ import annotations

import json
import os
import shutil

from omnickpt.export.destination import FULL_DISK_HINT, Destination
from omnickpt.storage.base import os_failure

CONFIG = "config.json"
# Copied as they are when the source folder has them and the export does not write them.
SIDECARS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
            "preprocessor_config.json")
_MAX_CONFIG_BYTES = 16 << 20   # a config.json is kilobytes: a larger file is not one


def folder_config(src: str) -> dict | None:
    """The source folder's own config.json as a dict, None when there is none (or it is no JSON object)."""
    path = os.path.join(str(src), CONFIG)
    if not os.path.isfile(path) or os.path.getsize(path) > _MAX_CONFIG_BYTES:
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def copy_sidecars(src: str, dest: Destination, durable: bool) -> list[str]:
    """Copy the source folder's SIDECARS that `dest` lacks; returns their names."""
    copied = []
    for name in SIDECARS:
        source = os.path.join(str(src), name)
        if not os.path.isfile(source) or os.path.exists(os.path.join(dest.path, name)):
            continue
        path = dest.file(name)
        try:
            with open(source, "rb") as fin, open(path, "xb") as fout:
                dest.wrote(path)
                shutil.copyfileobj(fin, fout, 1 << 20)
                if durable:
                    fout.flush()
                    os.fsync(fout.fileno())
        except OSError as e:
            raise os_failure("copying a file of the Hugging Face folder", path, e, device=path,
                             hint=FULL_DISK_HINT) from e
        copied.append(name)
    return copied

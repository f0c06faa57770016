"""An EAGLE-style draft head: one decoder layer that reads the target's own hidden states.

Row p of the head reads [embedding of token x_p ; feature of position p - 1] through `fc`, runs one Llama decoder
layer with its own KV cache, normalises, and scores the next token x_{p+1} over a reduced vocabulary (the
`draft_vocab_size` tokens the target emits most often, `token_map[i]` = target id of draft token i; EAGLE-3 /
FR-Spec). The feature of a committed position is the target's final normed hidden state there
(`forward_with_hidden(..., hidden_layers=(-1,))`, the vector its LM head reads); past the committed tokens the head
feeds back its own normed output, which training regresses onto the target's feature. Row 0 reads a zero feature,
so head positions equal token positions and the head's KV cache rolls back exactly like the target's.

The head owns only `fc`, the layer and the norm (a few MB). It borrows the target's embedding table, and its LM head
is the target's LM head restricted to `token_map`'s rows (the full-vocabulary head would be >80% of a head step), so
a head is tied to one target: `target_fingerprint` names it, and loading against another target is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specd.errors import ModelLoadError
from specd.model.attention import AttentionMetadata, ForwardBatch
from specd.model.kv_cache import KVCache
from specd.model.llama import DecoderLayer, Linear, LlamaForCausalLM, RMSNorm, Rotary

HEAD_CONFIG_FILE = "config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"
HEAD_FORMAT = "specd-eagle-head-v1"


@dataclass(frozen=True, slots=True)
class DraftHeadConfig:
    """What a trained head is and which target it belongs to (config.json of a head directory).

    target_fingerprint: `target_fingerprint(target)` of the model it was trained against.
    draft_vocab_size: rows of the reduced LM head (<= the target's vocabulary).
    """

    target_fingerprint: str
    target_name: str
    draft_vocab_size: int
    format: str = HEAD_FORMAT

    def __post_init__(self) -> None:
        if self.format != HEAD_FORMAT:
            raise ModelLoadError(f"format: {self.format!r} is not {HEAD_FORMAT!r}")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size <= 0:
            raise ModelLoadError(f"draft_vocab_size: must be a positive integer, got {self.draft_vocab_size!r}")
        if not self.target_fingerprint:
            raise ModelLoadError("target_fingerprint: must be non-empty")


def target_fingerprint(target: LlamaForCausalLM) -> str:
    """A short hash of the target's architecture and of tensors it keeps dense (embedding table, norms).

    Rounded to bfloat16 first, so the same checkpoint loaded as float32, bfloat16 or int4 gives the same name.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(asdict(target.config), sort_keys=True, default=str).encode())
    dense = [target.embed_tokens.weight, target.norm.weight]
    dense += [layer.input_layernorm.weight for layer in target.layers]
    dense += [layer.post_attention_layernorm.weight for layer in target.layers]
    for tensor in dense:
        digest.update(tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


class HeadOutput(NamedTuple):
    """logits: [num_logit_rows, draft_vocab_size] float32 (float64 for float64 heads), over draft ids.
    hidden: [num_tokens, hidden_size], the head's normed output of every row (the feature fed back to the next
    row)."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DraftHead(nn.Module):
    """The head's own weights plus borrowed views of the target's embedding table and LM-head rows."""

    def __init__(self, target: LlamaForCausalLM, config: DraftHeadConfig, token_map: torch.Tensor) -> None:
        super().__init__()
        arch = target.config
        if config.draft_vocab_size > arch.vocab_size:
            raise ModelLoadError(
                f"draft_vocab_size: {config.draft_vocab_size} exceeds the target's vocabulary {arch.vocab_size}"
            )
        if token_map.shape != (config.draft_vocab_size,) or not bool(
            ((token_map >= 0) & (token_map < arch.vocab_size)).all()
        ):
            raise ModelLoadError("token_map: must hold draft_vocab_size target token ids")
        self.config = config
        self.arch = replace(arch, num_layers=1)
        hidden = arch.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(self.arch, 0)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.rotary = Rotary(arch, arch.max_position_embeddings)
        self.register_buffer("token_map", token_map.to(torch.long).clone(), persistent=False)  # [draft_vocab]
        # Borrowed from the target, so not registered (not saved, not trained): a plain attribute.
        self._embed = [target.embed_tokens]
        lm_weight = target.embed_tokens.weight if target.lm_head is None else target.lm_head.hf_weight
        lm_rows = lm_weight.detach()[self.token_map].clone()  # [draft_vocab, hidden]
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(lm_rows, requires_grad=False)

    # ------------------------------------------------------------- building
    @classmethod
    def initialise(cls, target: LlamaForCausalLM, token_map: torch.Tensor, target_name: str,
                   seed: int = 0) -> DraftHead:
        """A fresh float32 head for training: the layer and norm start as copies of the target's last layer and
        final norm (a prior that learns faster from little data than a random layer), and fc as half the token's
        embedding (scaled up to the feature's size) plus half the previous feature, so both inputs reach the layer
        from the first step. (Starting from the feature alone, the embedding's share was ~3% and took most of a
        short training run to grow.)"""
        config = DraftHeadConfig(target_fingerprint(target), target_name, int(token_map.numel()))
        head = cls(target, config, token_map).float()
        hidden = target.config.hidden_size
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            last = target.layers[-1]
            for name, mine in head.layer.named_modules():
                theirs = last.get_submodule(name) if name else last
                if isinstance(mine, Linear) and isinstance(theirs, Linear):
                    mine.weight.copy_(theirs.hf_weight.float())
                    if mine.bias is not None and theirs.bias is not None:
                        mine.bias.copy_(theirs.bias.float())
                elif isinstance(mine, RMSNorm) and isinstance(theirs, RMSNorm):
                    mine.weight.copy_(theirs.weight.float())
            head.norm.weight.copy_(target.norm.weight.float())
            # A normed feature's RMS is about its norm weight's RMS.
            feature_rms = float(target.norm.weight.float().pow(2).mean().sqrt())
            embedding_rms = float(target.embed_tokens.weight.float().pow(2).mean().sqrt())
            fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
            fc[:, :hidden] += 0.5 * feature_rms / max(embedding_rms, 1e-6) * torch.eye(hidden)
            fc[:, hidden:] += 0.5 * torch.eye(hidden)
            head.fc.weight.copy_(fc)
        return head

    def for_inference(self, dtype: torch.dtype) -> DraftHead:
        """Cast to the target's dtype and pack the matmuls for small-M CPU GEMMs (see Linear.pack)."""
        head = self.to(dtype).eval()
        for module in head.modules():
            if isinstance(module, Linear):
                module.pack()
        return head

    @property
    def embed(self) -> nn.Embedding:
        return self._embed[0]

    def make_cache(self, max_slots: int, max_len: int) -> KVCache:
        a = self.arch
        return KVCache(1, a.num_kv_heads, a.head_dim, max_slots, max_len, self.norm.weight.dtype,
                       self.norm.weight.device)

    # -------------------------------------------------------------- forward
    def fuse(
        self,
        token_ids: torch.Tensor,  # [num_tokens]
        features: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:  # [num_tokens, hidden_size], the layer's input
        # The borrowed table is the target's: detached, so training never computes a gradient for it.
        embeddings = self.embed(token_ids).detach().to(features.dtype)
        return self.fc(torch.cat([embeddings, features], dim=-1))

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] normed -> [rows, draft_vocab]
        logits = self.lm_head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        features: torch.Tensor,  # [num_tokens, hidden_size], the feature of each row's previous position
    ) -> HeadOutput:
        """Run rows through the head, writing their KV into `cache` at their positions (the caller reserves
        capacity and commits or rolls back lengths, as for the target)."""
        meta = AttentionMetadata.build(batch)
        x = self.fuse(batch.token_ids, features.to(self.norm.weight.dtype))
        rope = self.rotary.tables(batch.positions, x.dtype)
        hidden = self.norm(self.layer(x, rope, cache, meta))  # [num_tokens, hidden_size]
        return HeadOutput(self.scores(hidden[batch.logits_indices]), hidden)

    # --------------------------------------------------------------- saving
    def save(self, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Write head.safetensors (fc, layer, norm and the token map) and config.json (+ `extra` under
        "training", e.g. the command and data that made it)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        # bfloat16 halves the file; a draft's rounding costs acceptance, never correctness.
        tensors = {name: p.detach().to(torch.bfloat16).contiguous()
                   for name, p in self.named_parameters() if not name.startswith("lm_head")}
        tensors["token_map"] = self.token_map.to(torch.int32).contiguous()
        save_file(tensors, str(out / HEAD_WEIGHTS_FILE))
        document = {**asdict(self.config), "hidden_size": self.arch.hidden_size, "training": extra or {}}
        (out / HEAD_CONFIG_FILE).write_text(json.dumps(document, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, target: LlamaForCausalLM) -> DraftHead:
        """Load a saved head for `target` (float32, unpacked: call for_inference). Refuses a head trained for
        another target, naming both fingerprints."""
        path = Path(directory)
        config_path, weights_path = path / HEAD_CONFIG_FILE, path / HEAD_WEIGHTS_FILE
        if not config_path.is_file() or not weights_path.is_file():
            raise ModelLoadError(f"draft_model: {path} is not a draft-head directory "
                                 f"(expected {HEAD_CONFIG_FILE} and {HEAD_WEIGHTS_FILE})")
        try:
            document = json.loads(config_path.read_text())
            config = DraftHeadConfig(document["target_fingerprint"], document["target_name"],
                                     int(document["draft_vocab_size"]), document.get("format", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"draft_model: {config_path} is not a valid head config ({exc})") from exc
        actual = target_fingerprint(target)
        if config.target_fingerprint != actual:
            raise ModelLoadError(
                f"draft_model: the head in {path} was trained for target {config.target_name!r} (fingerprint "
                f"{config.target_fingerprint}), not this model (fingerprint {actual}); train one with "
                "`specd train-draft`"
            )
        tensors = load_file(str(weights_path))
        head = cls(target, config, tensors.pop("token_map").to(torch.long)).float()
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        missing = [name for name in missing if not name.startswith("lm_head")]
        if missing or unexpected:
            raise ModelLoadError(f"draft_model: {weights_path} has missing {missing} / unexpected {unexpected} tensors")
        return head

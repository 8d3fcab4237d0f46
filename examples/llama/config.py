"""The model shape: a Hugging Face Llama ``config.json`` as a small dataclass, and back."""
from __future__ import annotations

import dataclasses
import json
import pathlib

from cupy_paged._core.types import HEAD_DIMS  # the head dims the attention serves

# config.json keys that change the math and that this engine does not implement: refused on load
# rather than silently computing another model.
_UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "sliding_window": None}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama ``config.json`` that the forward pass reads.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` as in HF.  ``rope_scaling``
    is None, ``{"rope_type": "linear", "factor": f}`` or Llama 3's ``{"rope_type": "llama3", ...}``.

    Examples
    --------
    >>> c = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    ...                 num_attention_heads=4, num_key_value_heads=2)
    >>> c.head_dim, c.q_size, c.kv_size
    (32, 128, 64)
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS} (the attention's head dims); got {self.head_dim}")

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, values: dict) -> "LlamaConfig":
        """From a parsed ``config.json``; unknown keys are ignored, unsupported features refused, and
        so is any model that is not a Llama (another ``model_type`` or architecture: Qwen2's biases,
        Mistral's sliding window, ... would be dropped and another model computed)."""
        model_type = values.get("model_type", "llama")
        architectures = values.get("architectures") or ["LlamaForCausalLM"]
        if model_type != "llama" or "LlamaForCausalLM" not in architectures:
            raise ValueError(f"config.json describes model_type {model_type!r} ({', '.join(map(str, architectures))}); "
                             "this engine serves Llama models (LlamaForCausalLM) only")
        missing = [key for key in _REQUIRED if key not in values]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a Llama config")
        for key, wanted in _UNSUPPORTED.items():
            if values.get(key, wanted) != wanted:
                raise ValueError(f"config.json has {key} = {values[key]!r}; this engine implements {wanted!r}")
        eos = values.get("eos_token_id")
        if isinstance(eos, list):  # Llama 3 lists several; generation stops at the first here
            eos = eos[0] if eos else None
        rope = values.get("rope_parameters")  # newer transformers keep theta and scaling together
        if isinstance(rope, dict):
            values = dict(values, rope_theta=rope.get("rope_theta", values.get("rope_theta")),
                          rope_scaling=None if rope.get("rope_type", "default") == "default" else rope)
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in names and v is not None}
        kept["eos_token_id"] = eos
        kept.setdefault("num_key_value_heads", kept["num_attention_heads"])
        return cls(**kept)

    @classmethod
    def load(cls, folder) -> "LlamaConfig":
        """Read ``folder/config.json``."""
        return cls.from_dict(json.loads((pathlib.Path(folder) / "config.json").read_text()))

    def to_dict(self, torch_dtype: str = "bfloat16") -> dict:
        """A ``config.json`` that Hugging Face's ``LlamaForCausalLM`` reads as this model."""
        values = dataclasses.asdict(self)
        values.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                      attention_bias=False, mlp_bias=False, torch_dtype=torch_dtype)
        return values

    def save(self, folder, torch_dtype: str = "bfloat16") -> None:
        """Write ``folder/config.json``."""
        path = pathlib.Path(folder) / "config.json"
        path.write_text(json.dumps(self.to_dict(torch_dtype), indent=2) + "\n")


# Built-in shapes of the CLI: a GPU-sized model (about 0.6 B parameters) and a CPU-sized one that
# the reference backend serves in seconds.
GPU_DEFAULT = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, head_dim=128, rope_theta=10000.0,
                          max_position_embeddings=4096)
CPU_DEFAULT = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                          max_position_embeddings=2048)

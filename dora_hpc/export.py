"""``dora-hpc export RUN_DIR [--step N] --out DIR [--merged]``: a run's checkpoint as a Hugging Face model folder;
a ``train.lora`` run's as a peft adapter folder over its model folder, or with ``--merged`` as a whole model.

The folder holds config.json, generation_config.json, the tokenizer files and safetensors weights
(sharded past ``--max-shard-size``), in float32 or bfloat16: ``AutoModelForCausalLM.from_pretrained``
and vLLM load it as they load any model. Every trainer backend's checkpoint stores one full state dict
under the model's own parameter names, so torch, FSDP2 and megatron checkpoints export alike.

Invariants: the default is the newest checkpoint that verifies, and a missing or corrupt step is an
error naming it (exit 2); the folder is written as DIR.tmp and renamed whole, so a folder at DIR is
complete; an existing DIR is never overwritten; every weight of the model comes from the checkpoint
(only a tied output head may be absent from it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import fail
from .evaluate import EvalError, resolve
from .train.lora import LoraSpec, attach, load_adapter_state

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class ExportError(EvalError):
    """A bad run, step or output folder: one line, exit 2."""


def export(run_dir: str, step: int | None, out: Path, dtype: str = "float32", max_shard_size: str = "5GB",
           console=None, merged: bool = False) -> dict:
    from rich.progress import Progress

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if not (Path(run_dir) / "launch.json").is_file():
        raise ExportError(f"{run_dir}: not a run directory (no launch.json)")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out}: exists and is not empty; choose a new folder")
    with Progress(console=console, transient=True) as bar:
        job = bar.add_task(f"export {run_dir}", total=4)
        target = resolve(run_dir, step, None, [])
        lora = LoraSpec.of(target.cfg)
        if merged and lora is None:
            raise ExportError(f"--merged: {run_dir} trained the whole model (no train.lora); its export is whole")
        bar.advance(job)
        import torch  # after every check: a bad argument fails in a fraction of a second
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.float32)
        kind, save = ("merged" if lora is not None else "model"), {"max_shard_size": max_shard_size}
        if lora is not None and not merged:  # a peft adapter folder over the run's model folder
            kind, save, model = "adapter", {}, attach(model, lora)
            if target.adapter is not None:  # (step 0: the fresh adapter)
                load_adapter_state(model, target.adapter)
        elif target.weights is not None:
            missing, unexpected = model.load_state_dict(target.weights, strict=False)
            tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise ExportError(f"{target.label}: the checkpoint does not match the model in {target.model_dir} "
                                  f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
        bar.advance(job)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.to(getattr(torch, DTYPES[dtype])).save_pretrained(tmp, safe_serialization=True, **save)
        bar.advance(job)
        AutoTokenizer.from_pretrained(target.model_dir).save_pretrained(tmp)
        info = {"run_dir": str(Path(run_dir).resolve()), "step": target.step, "dtype": DTYPES[dtype],
                "source_model": str(target.model_dir), "from": target.label, "kind": kind}
        (tmp / "dora_hpc_export.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
        bar.advance(job)
    return info | {"out": str(out), "files": sorted(p.name for p in out.iterdir())}


def cmd_export(args, console) -> int:

    from . import quiet_hf

    quiet_hf()
    try:
        info = export(args.run_dir, args.step, Path(args.out), args.dtype, args.max_shard_size, console=console,
                      merged=args.merged)
    except EvalError as e:
        return fail("export", e)
    console.print(f"exported {info['from']} ({info['kind']}, {info['dtype']}) to {info['out']}: "
                  f"{', '.join(info['files'])}",
                  soft_wrap=True, highlight=False, markup=False)
    return 0


def add_parser(sub) -> None:
    ex = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model folder")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("--step", type=int, default=None, help="the checkpoint (default: the newest that verifies; "
                    "0: the initial model)")
    ex.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    ex.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="the weights' dtype")
    ex.add_argument("--max-shard-size", default="5GB", help="safetensors files are split past this size")
    ex.add_argument("--merged", action="store_true", help="a train.lora run: its adapter merged into the model "
                    "folder's weights, a whole model (default: the peft adapter folder)")
    ex.set_defaults(func=cmd_export)

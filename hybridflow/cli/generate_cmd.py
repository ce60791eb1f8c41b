"""``hybridflow generate --model DIR --prompts FILE.jsonl --out FILE.jsonl``: run the rollout engine alone."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.cli.output import add_overwrite_flag, check_output_file
from hybridflow.utils.errors import MissingFileError, UserError

if TYPE_CHECKING:
    from hybridflow.engine import GenerationOutput, SamplingParams

NAME = "generate"
HELP = "Generate responses for a JSONL file of prompts with the built-in rollout engine."

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the model, prompt, output and sampling options."""
    parser.add_argument("--model", required=True, help="Local Hugging Face model directory.")
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer directory, when it is not the --model directory."
    )
    parser.add_argument(
        "--prompts",
        required=True,
        help='JSONL file: one object per line with "prompt" (text, or chat messages) or "messages".',
    )
    parser.add_argument("--out", required=True, help="Output JSONL file, one line per sample.")
    add_overwrite_flag(parser, "an existing --out file")
    parser.add_argument("--n", type=int, default=1, help="Samples per prompt.")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="Most tokens generated per sample.")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus mass (1 = off).")
    parser.add_argument("--top-k", type=int, default=-1, help="Top-k cut-off (-1 = off).")
    parser.add_argument("--min-p", type=float, default=0.0, help="Min-p cut-off (0 = off).")
    parser.add_argument("--greedy", action="store_true", help="Greedy decoding.")
    parser.add_argument(
        "--seed", type=int, default=None, help="Seed: the same seed and inputs give the same output."
    )
    parser.add_argument("--ignore-eos", action="store_true", help="Generate max-new-tokens every time.")
    parser.add_argument("--engine", choices=["native", "hf"], default="native", help="Generation engine.")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32."
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda.")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences decoded at once.")
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="torch.compile the decode step (GPU, native engine): faster decode after tens of seconds of compiling.",
    )


def read_prompts(path: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of each prompt line; chat messages get the chat template with a generation prompt.

    A line with ``messages`` and no chat ``prompt`` is a conversation: its prompt is every turn up to the last
    user turn (``data.conversations``), as in training.
    """
    file = Path(path)
    if not file.is_file():
        raise MissingFileError(f"prompts file {path} does not exist")
    prompts = []
    from hybridflow.data.conversations import resolve_prompt
    from hybridflow.data.rows import RowOrigin
    from hybridflow.utils.storage import read_utf8_lines

    for lineno, line in enumerate(read_utf8_lines(file), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        value = None
        if isinstance(row, dict):
            row = dict(row)  # the training data's rule: a conversation's prompt ends at its last user turn
            resolve_prompt(row, "prompt", RowOrigin(path, len(prompts), lineno))
            value = row.get("prompt")
        if isinstance(value, list):
            ids = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        elif isinstance(value, str):
            ids = tokenizer.encode(value, add_special_tokens=False)
        else:
            raise UserError(
                f'{path}:{lineno}: expected an object with "prompt" (text or chat messages) or "messages"'
            )
        if not ids:
            raise UserError(f"{path}:{lineno}: the prompt is empty")
        prompts.append(ids)
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    """Load the model, generate, write one JSON line per sample and report tokens/s."""
    import torch

    from hybridflow.engine import make_rollout
    from hybridflow.models import load_causal_lm, load_tokenizer
    from hybridflow.utils.device import cuda_in_use, use_device_type
    from hybridflow.utils.progress import Progress
    from hybridflow.utils.threads import configure_cpu_threads

    check_output_file(Path(args.out), args.overwrite)
    use_device_type(args.device, "--device")  # a missing GPU stops here, with the fix
    configure_cpu_threads(0, on_cpu=not cuda_in_use())  # utils/threads.py: sized to the CPUs free here
    device = torch.device("cuda" if cuda_in_use() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    tokenizer = load_tokenizer(args.tokenizer or args.model, fix_option="--tokenizer")
    model = load_causal_lm(args.model, dtype=dtype).to(device).eval()
    prompts = read_prompts(args.prompts, tokenizer)
    params = sampling_params(args, model, tokenizer)
    check_position_limit(args.prompts, prompts, params.max_new_tokens, model)
    extra = {"compile_decode": True} if args.compile_decode else {}  # (HF generate takes no such option)
    engine = make_rollout(
        model, args.engine, pad_token_id=tokenizer.pad_token_id or 0, max_num_seqs=args.max_num_seqs, **extra
    )
    start = time.perf_counter()
    with Progress("generate", total=len(prompts) * args.n, unit="sample") as bar:  # lines in a log file
        results = engine.generate(prompts, params, progress=bar.update)
    elapsed = time.perf_counter() - start
    total = write_samples(Path(args.out), results, tokenizer)
    print(
        f"{len(prompts) * args.n} samples, {total} tokens in {elapsed:.2f}s: {total / elapsed:,.0f} tokens/s "
        f"-> {args.out}"
    )
    return 0


def check_position_limit(path: str, prompts: list[list[int]], max_new_tokens: int, model: Any) -> None:
    """Refuse a prompt that fills the model's position limit; warn when one plus --max-new-tokens passes it."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        index = next(i for i, p in enumerate(prompts) if len(p) == longest)
        raise UserError(
            f"{path}: prompt {index + 1} has {longest} tokens, which fills the model's position limit "
            f"(max_position_embeddings={limit}) and leaves no room to generate; shorten it to fewer than "
            f"{limit} tokens"
        )
    if longest + max_new_tokens > limit:
        logger.warning(
            "the longest prompt (%d tokens) + --max-new-tokens %d = %d tokens is more than the model's "
            "position limit (max_position_embeddings=%d): its responses stop at %d tokens; lower "
            "--max-new-tokens to %d or shorten the prompts",
            longest,
            max_new_tokens,
            longest + max_new_tokens,
            limit,
            limit - longest,
            limit - longest,
        )


def sampling_params(args: argparse.Namespace, model: Any, tokenizer: Any) -> SamplingParams:
    """The command's SamplingParams; EOS ids from the model's generation config, else the tokenizer's."""
    from hybridflow.engine import SamplingParams

    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [tokenizer.eos_token_id])
    return SamplingParams(
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        do_sample=not args.greedy,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        eos_token_ids=[i for i in eos_ids if i is not None],
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def write_samples(path: Path, results: list[list[GenerationOutput]], tokenizer: Any) -> int:
    """Write one JSON line per sample to ``path``; returns the number of generated tokens."""
    from hybridflow.utils.storage import staged_file

    path.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with staged_file(path) as tmp, open(tmp, "w") as f:  # written beside and renamed when complete
        for i, samples in enumerate(results):
            for s, out in enumerate(samples):
                total += len(out.token_ids)
                line = {
                    "prompt_index": i,
                    "sample_index": s,
                    "text": tokenizer.decode(out.token_ids, skip_special_tokens=True),
                    "token_ids": out.token_ids,
                    "logprobs": out.logprobs,
                    "finish_reason": out.finish_reason,
                }
                f.write(json.dumps(line) + "\n")
    return total

"""``hybridflow serve --model DIR``: the OpenAI-compatible endpoint on the built-in rollout engine, alone
(inference and debugging of a harness against the model it will train)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from hybridflow.utils.errors import UserError

NAME = "serve"
HELP = "Serve a model over an OpenAI-compatible HTTP endpoint (chat completions, completions, models)."

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the model, address, token and engine options."""
    parser.add_argument("--model", required=True, help="Local Hugging Face model directory.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer directory, when not the --model one.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (loopback by default).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (0: a free one).")
    parser.add_argument(
        "--api-key",
        default=None,
        help="The bearer token clients must send (default: $HYBRIDFLOW_API_KEY, else a random one, printed).",
    )
    parser.add_argument("--served-model-name", default=None, help="The model's id in /v1/models.")
    parser.add_argument(
        "--tool-format", choices=["hermes", "plain"], default="hermes", help="Tool-call format."
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="Context length of the KV cache.")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="Most sequences decoded at once.")
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="Answer length when a request sets none."
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32."
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda.")


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a port; use 0 to 65535")
    for name in ("max_num_seqs", "max_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {args.max_model_len}")


def run(args: argparse.Namespace) -> int:
    """Load the model and serve until interrupted."""
    from hybridflow.serve import require_packages

    require_packages("hybridflow serve")
    import torch

    from hybridflow.engine import PagedEngine
    from hybridflow.models import load_causal_lm, load_tokenizer
    from hybridflow.serve.driver import EngineDriver
    from hybridflow.serve.server import Endpoint, ServerSettings
    from hybridflow.utils.device import cuda_in_use, use_device_type

    _check(args)
    use_device_type(args.device, "--device")
    device = torch.device("cuda" if cuda_in_use() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    tokenizer = load_tokenizer(args.tokenizer or args.model, fix_option="--tokenizer")
    model = load_causal_lm(args.model, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [tokenizer.eos_token_id])
    engine = PagedEngine(
        model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device=device
    )
    settings = ServerSettings(
        host=args.host, port=args.port, token=args.api_key or os.environ.get("HYBRIDFLOW_API_KEY") or None,
        model_name=args.served_model_name or os.path.basename(os.path.normpath(args.model)),
        tool_format=args.tool_format, default_max_tokens=args.max_tokens,
    )  # fmt: skip
    endpoint = Endpoint(
        EngineDriver(engine, tokenizer), tokenizer, [i for i in eos_ids if i is not None], settings
    )
    endpoint.start()
    print(f"serving {settings.model_name} at {endpoint.base_url()}", flush=True)
    if not (args.api_key or os.environ.get("HYBRIDFLOW_API_KEY")):
        print(f"bearer token: {endpoint.token}", flush=True)
    sys.stdout.flush()
    try:
        endpoint.driver.run_until(lambda: False)
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        endpoint.close()
    return 0

"""`titan-learner serve`: start one rollout server for a run (titan_learner.vllm.serve)."""

from __future__ import annotations

import argparse
import os
import sys


def add_serve_parser(commands) -> None:
    from titan_learner.cli.common import add_config_arguments

    serve = commands.add_parser(
        "serve",
        help="start a vLLM rollout server for a config's model ([rollout.vllm] servers)",
        description="Start a vLLM server that the job's [rollout.vllm] servers can use.",
    )
    add_config_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--gpus",
        default=None,
        help="CUDA devices for the server, e.g. 4,5,6,7, all used: tensor-parallel over them "
        "unless [rollout.vllm] sets the parallel sizes (default: as vLLM does, the first GPUs "
        "this process sees, as many as the parallel sizes take: one without them)",
    )
    serve.add_argument(
        "--text-routes",
        action="store_true",
        help="load the model's tokenizer too, so /v1/chat/completions and /v1/completions "
        "answer: an LLM judge's server (rollouts need only token ids)",
    )
    serve.add_argument(
        "--dry-run",
        action="store_true",
        help="print the server's command line (its variables first; the token as the line "
        "reads it, never its value) and exit",
    )
    serve.add_argument(
        "vllm_flags",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_FLAGS",
        help="flags of vLLM's server front end, passed as they are (e.g. -- "
        "--disable-uvicorn-access-log, or --ssl-keyfile KEY --ssl-certfile CERT for TLS); "
        "engine arguments go in [rollout.vllm], where the job checks them",
    )


def serve(args: argparse.Namespace) -> int:
    from titan_learner.cli.common import user_error
    from titan_learner.config.errors import ConfigError
    from titan_learner.config.toml import load_config
    from titan_learner.vllm.checks import check_vllm_structure
    from titan_learner.vllm.serve import (
        dry_run_line,
        front_end_flags,
        parse_gpus,
        server_command,
    )

    try:
        gpus = parse_gpus(args.gpus) if args.gpus is not None else None
    except ValueError as err:
        return user_error(err)
    try:
        config = load_config(args.config, args.overrides)
        if not args.text_routes:  # a judge's server takes its own prompts, not the run's
            check_vllm_structure(config)  # what the job would refuse, before a server starts
        argv, env = server_command(
            config,
            host=args.host,
            port=args.port,
            on_gpu=gpus is not None or _sees_a_gpu(),
            python=sys.executable,
            text_routes=args.text_routes,
            gpus=gpus,
        )
        flags = args.vllm_flags[1:] if args.vllm_flags[:1] == ["--"] else args.vllm_flags
        argv += front_end_flags(flags, argv)
    except (ConfigError, ValueError) as err:
        return user_error(err)
    if args.dry_run:
        print(dry_run_line(argv, env, config))
        return 0
    sys.stdout.flush()
    os.execvpe(argv[0], argv, {**os.environ, **env})  # the server takes this process over


def _sees_a_gpu() -> bool:
    import torch

    return torch.cuda.is_available()

"""``radixserve-client``: generate text or chat from the command line.

    radixserve-client generate "The capital of France is" --stream --max-new-tokens 32
    radixserve-client chat "What is the capital of France?"
    radixserve-client generate "SELECT" --lora-id sql   # with the LoRA adapter named sql
    radixserve-client chat                      # interactive; empty line or Ctrl-D ends
    RADIXSERVE_API_KEY=... radixserve-client --tls-ca ca.pem --server host:30000 chat "Hi"

Sampling defaults to greedy (temperature 0) so answers are reproducible.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from clients.client import RadixClient

DEFAULT_SERVER = "127.0.0.1:30000"
SERVER_ENV = "RADIXSERVE_SERVER"
API_KEY_ENV = "RADIXSERVE_API_KEY"


def _sampling(args: argparse.Namespace) -> dict:
    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "stop": args.stop or [],
        "n": args.n,
    }
    if args.json_schema:
        sampling["json_schema"] = Path(args.json_schema).read_text()
    if args.priority is not None:
        sampling["priority"] = args.priority
    if args.routing_key is not None:
        sampling["routing_key"] = args.routing_key
    if args.regex:
        sampling["regex"] = args.regex
    if args.ebnf:
        sampling["ebnf"] = Path(args.ebnf).read_text()
    return sampling


def _print_stream(events, out=sys.stdout) -> str:
    text = ""
    for event in events:
        out.write(event.text)
        out.flush()
        text += event.text
        if event.finish_reason is not None and event.finish_reason != "stop":
            out.write(f"  [{event.finish_reason}]")
    out.write("\n")
    return text


def _generate(client: RadixClient, args: argparse.Namespace) -> None:
    if args.stream and args.n == 1:
        _print_stream(client.stream(args.prompt, lora_id=args.lora_id, **_sampling(args)))
        return
    result = client.generate(args.prompt, lora_id=args.lora_id, **_sampling(args))
    for choice in result.choices:
        prefix = f"[{choice.index}] " if len(result.choices) > 1 else ""
        print(f"{prefix}{choice.text}")
        if args.verbose:
            print(
                f"  finish={choice.finish_reason} prompt={choice.prompt_tokens} "
                f"completion={choice.completion_tokens} cached={choice.cached_tokens}",
                file=sys.stderr,
            )


def _chat(client: RadixClient, args: argparse.Namespace) -> None:
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None
    while True:
        if interactive:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return
            if not line:
                return
            print("model> ", end="", flush=True)
        else:
            line = args.message
        messages.append({"role": "user", "content": line})
        reply = _print_stream(
            client.chat(messages, stream=True, lora_id=args.lora_id, **_sampling(args))
        )
        messages.append({"role": "assistant", "content": reply})
        if not interactive:
            return


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve-client", description=__doc__.split("\n")[0])
    p.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV, DEFAULT_SERVER),
        help=f"HOST:PORT of the scheduler (default: ${SERVER_ENV} or {DEFAULT_SERVER})",
    )
    p.add_argument("--tls", action="store_true", help="TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", metavar="PATH", help="TLS, trusting this CA (PEM)")
    p.add_argument(
        "--tls-server-name", metavar="NAME", help="expect this name in the server's certificate"
    )
    # The environment is the better place for a secret: flags show in `ps`.
    p.add_argument(
        "--api-key",
        # A key from a Kubernetes Secret file often ends with a newline.
        default=os.environ.get(API_KEY_ENV, "").strip() or None,
        help=f"sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt")
    g.add_argument("prompt")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--verbose", "-v", action="store_true")
    c = sub.add_parser("chat", help="chat through the model's chat template")
    c.add_argument("message", nargs="?", help="one message (omit for an interactive chat)")
    c.add_argument("--system", default=None)
    for sp in (g, c):
        sp.add_argument(
            "--lora-id",
            metavar="ID",
            default=None,
            help="the LoRA adapter to generate with (its name on the server); default: none",
        )
        sp.add_argument("--max-new-tokens", type=int, default=256)
        sp.add_argument("--temperature", type=float, default=0.0)
        sp.add_argument("--top-p", type=float, default=1.0)
        sp.add_argument("--top-k", type=int, default=-1)
        sp.add_argument("--stop", action="append", help="a stop string (repeatable)")
        sp.add_argument("--n", type=int, default=1)
        sp.add_argument(
            "--priority",
            type=int,
            default=None,
            help="the request's priority (the server orders and preempts by it with "
            "--enable-priority-scheduling)",
        )
        sp.add_argument(
            "--routing-key",
            metavar="KEY",
            default=None,
            help="the request's routing key (the server's routing-key policy batches "
            "requests with the same key)",
        )
        grammar = sp.add_mutually_exclusive_group()
        grammar.add_argument(
            "--json-schema", metavar="FILE", help="the output is JSON valid against this schema"
        )
        grammar.add_argument("--regex", help="the output fully matches this regular expression")
        grammar.add_argument("--ebnf", metavar="FILE", help="the output follows this EBNF grammar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.tls_ca and not os.path.isfile(args.tls_ca):
        p.error(f"--tls-ca {args.tls_ca}: no such file")
    for flag in ("json_schema", "ebnf"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            p.error(f"--{flag.replace('_', '-')} {path}: no such file")
    client = RadixClient(
        args.server,
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
        api_key=args.api_key,
    )
    try:
        if args.command == "generate":
            _generate(client, args)
        else:
            _chat(client, args)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

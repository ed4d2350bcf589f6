"""`make demo`'s client: one chat request to a running server through the `openai` client.

python -m pd.tools.demo [--url http://127.0.0.1:8888/v1] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pd.tools.demo")
    p.add_argument("--url", default="http://127.0.0.1:8888/v1")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop-command", default="deploy/server.sh stop", help="how the user stops the server")
    args = p.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=args.url, api_key="unused")
    model = client.models.list().data[0].id
    print(f"model: {model}\nuser: {args.prompt}")
    t0 = time.monotonic()
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
    )
    dt = time.monotonic() - t0
    print(f"assistant: {reply.choices[0].message.content}")
    u = reply.usage
    if u is not None:
        print(f"({u.prompt_tokens} prompt + {u.completion_tokens} completion tokens in {dt:.1f} s)")
    print(f"The server keeps running; stop it with: {args.stop_command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

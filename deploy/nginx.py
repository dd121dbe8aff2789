#!/usr/bin/env python
"""Fill in deploy/nginx.conf for a set of replicas and print it (no Django, no packages).

    python deploy/nginx.py --listen 8000 --upstream 127.0.0.1:8101 --upstream 127.0.0.1:8102 \
        --run-dir .run/nginx --max-body 101M > .run/nginx/nginx.conf
    nginx -c "$PWD/.run/nginx/nginx.conf" -g "daemon off;"
"""
import argparse
import os
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "nginx.conf"
FAIL_TIMEOUT_S = 5  # a replica that refused a connection is skipped this long


def render(listen: str, upstreams: list[str], run_dir: str, max_body: str) -> str:
    servers = "\n".join(f"        server {u} max_fails=1 fail_timeout={FAIL_TIMEOUT_S}s;" for u in upstreams)
    fields = {"@LISTEN@": listen, "@UPSTREAMS@": servers, "@RUN_DIR@": run_dir, "@MAX_BODY@": max_body}
    text = TEMPLATE.read_text()
    for name, value in fields.items():
        text = text.replace(name, value)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="address:port or port")
    parser.add_argument("--upstream", action="append", required=True, help="a replica's host:port (repeat)")
    parser.add_argument("--run-dir", required=True, help="where nginx keeps its pid, log and temporary files")
    parser.add_argument("--max-body", default="101M", help="client_max_body_size: FILES_MAX_BYTES and its form")
    args = parser.parse_args()
    run_dir = os.path.abspath(args.run_dir)
    print(render(args.listen, args.upstream, run_dir, args.max_body), end="")


if __name__ == "__main__":
    main()

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


def render(listen: str, upstreams: list[str], run_dir: str, max_body: str) -> str:
    # max_fails=0: nginx's passive marking let a replica back only through one probe request
    # per fail_timeout and counted it failed until that probe completed; with a stream as the
    # probe, a replica refused once while loading stayed out of its worker's rotation for the
    # stream's whole life, and when the other replica died every request got 502 "no live
    # upstreams" (tests/cluster's kill -9 test). Every request now tries its hashed replica and
    # goes on to the next when the connect is refused (proxy_next_upstream).
    servers = "\n".join(f"        server {u} max_fails=0;" for u in upstreams)
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

"""How many usage entries a web process's ledger writes a second: each entry in a transaction
of its own (the ledger before apply_usage_batch) against what arrived together in one
(tenants.ledger.APPLY_BATCH), side by side in one run, on a fresh database.

Each of `--requests` generations hands the ledger two entries, `open` and `close`, all at
once; the time runs until the database holds every row closed. The database is a fresh
PostgreSQL one on the server DATABASE_URL names, else a temporary SQLite file.

    .venv/bin/python bench/ledger.py [--requests 2000] [--rounds 3]   # ~1 minute
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="generations per round (two entries each)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, the modes taking turns")
    args = parser.parse_args()

    from tests.live import _database

    tmp = Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    url, drop = _database(tmp)
    os.environ.update(DATABASE_URL=url, USAGE_OUTBOX_DIR=str(tmp / "outbox"), DJANGO_SETTINGS_MODULE="config.settings",
                      DEBUG="false")
    os.environ.pop("DJANGO_ENV", None)
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    try:
        call_command("migrate", verbosity=0)
        from tenants import ledger as module
        from tenants.models import QuotaTier, Tenant, UsageRecord

        tenant = Tenant.objects.create(name="bench", tier=QuotaTier.objects.get(name="standard"))
        journal = module.ledger()
        batched = module.APPLY_BATCH

        def one_round(per_transaction: int, round_no: int) -> float:
            module.APPLY_BATCH = per_transaction
            created = timezone.now().isoformat()
            keys = [f"gen-{per_transaction}-{round_no}-{i}" for i in range(args.requests)]
            start = time.perf_counter()
            for key in keys:
                journal.submit(module.UsageEntry(op="open", key=key, tenant_id=tenant.pk, lane=1, created=created,
                                                 request_id=key, model="m", prompt_tokens=30))
            for key in keys:
                journal.submit(module.UsageEntry(op="close", key=key, tenant_id=tenant.pk, lane=1, created=created,
                                                 request_id=key, model="m", prompt_tokens=30, completion_tokens=50,
                                                 finish_reason="length"))
            while journal.unapplied():
                time.sleep(0.005)
            seconds = time.perf_counter() - start
            assert UsageRecord.objects.filter(key__in=keys, closed=True, completion_tokens=50).count() == len(keys)
            return 2 * args.requests / seconds

        rates: dict[int, list[float]] = {1: [], batched: []}
        for r in range(args.rounds):
            for per_transaction in ((1, batched) if r % 2 == 0 else (batched, 1)):
                rates[per_transaction].append(one_round(per_transaction, r))
        one, many = statistics.median(rates[1]), statistics.median(rates[batched])
        print(f"\n{connection.vendor}, {args.requests} generations (2 entries each) at once, median of {args.rounds} rounds\n")
        print("| entries per transaction | entries/s | rounds |")
        print("|---|---|---|")
        print(f"| 1 (before) | {one:.0f} | {', '.join(f'{x:.0f}' for x in rates[1])} |")
        print(f"| up to {batched} | {many:.0f} | {', '.join(f'{x:.0f}' for x in rates[batched])} |")
        print(f"\nbatched vs one at a time: {many / one:.2f}x")
    finally:
        connection.close()
        drop()


if __name__ == "__main__":
    main()

"""`manage.py export_usage --since 2026-11-01 --until 2026-12-01 --format csv|jsonl [--tenant T] [--output F]`."""
import csv
import json
from datetime import datetime, time, timezone as dt_timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tenants import usage
from tenants.management import lookup


def _when(text: str) -> datetime:
    """A date (midnight UTC) or an ISO 8601 time (UTC unless it says otherwise)."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"{text!r} is not a date (2026-11-01) or an ISO 8601 time.") from None
    if len(text) <= 10:
        at = datetime.combine(at.date(), time())
    return at if at.tzinfo else at.replace(tzinfo=dt_timezone.utc)


class Command(BaseCommand):
    help = "Export usage records created in [--since, --until) as CSV or JSON lines, oldest first."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--since", required=True, help="a date or ISO 8601 time, inclusive")
        parser.add_argument("--until", required=True, help="a date or ISO 8601 time, exclusive")
        parser.add_argument("--format", choices=["csv", "jsonl"], default="csv")
        parser.add_argument("--tenant", help="one tenant (name or id); default all")
        parser.add_argument("--output", help="a file to write; default standard output")

    def handle(self, *args: Any, **options: Any) -> None:
        since, until = _when(options["since"]), _when(options["until"])
        if until <= since:
            raise CommandError("--until must be after --since.")
        tenant = lookup.tenant(options["tenant"]) if options["tenant"] else None
        rows = usage.export_rows(since, until, tenant)
        self.stdout.ending = ""  # rows carry their own line ends
        out = open(options["output"], "w", newline="", encoding="utf-8") if options["output"] else self.stdout
        count = 0
        try:
            if options["format"] == "csv":
                writer = csv.DictWriter(out, fieldnames=usage.EXPORT_FIELDS)
                writer.writeheader()
                for row in rows:
                    writer.writerow(row)
                    count += 1
            else:
                for row in rows:
                    out.write(json.dumps(row) + "\n")
                    count += 1
        finally:
            if out is not self.stdout:
                out.close()
        self.stderr.write(f"{count} usage records from {since.isoformat()} to {until.isoformat()}.")

"""`manage.py replay_usage_dead_letters`: write the usage entries the database refused for a day."""
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tenants import ledger


class Command(BaseCommand):
    help = ("Apply the usage outbox's dead-letter entries (USAGE_OUTBOX_DIR/dead-letter.jsonl) once the cause "
            "is fixed; those still refused stay in the file.")

    def handle(self, *args: Any, **options: Any) -> None:
        directory = Path(settings.USAGE_OUTBOX_DIR)
        applied, left = ledger.replay_dead_letters(directory)
        self.stdout.write(f"{applied} usage entries written, {left} left in {directory / ledger.DEAD_LETTER}.")
        if left:
            raise CommandError(f"{left} entries are still refused: the log says why.")

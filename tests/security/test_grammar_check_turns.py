"""A tenant's grammar checks run one at a time (inference.grammar_checks), and a check whose
client left still holds its tenant's turn until its thread is done: released at once, a tenant
that sent a large schema and left, over and over, kept every thread of the check pool
compiling its schemas while other tenants' checks waited."""
import asyncio
import threading

from inference import grammar_checks

SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}


def test_a_check_whose_client_left_keeps_its_tenants_turn_until_its_thread_is_done():
    entered: list[int] = []
    release = threading.Event()

    def compile_(data: dict) -> int:  # stands in for llguidance compiling a large schema
        entered.append(data["n"])
        release.wait(10)
        return data["n"]

    async def scenario() -> list[int]:
        left = asyncio.create_task(grammar_checks.parse(compile_, {**SCHEMA, "n": 1}, "tenant-a"))
        for _ in range(200):
            if entered:
                break
            await asyncio.sleep(0.01)
        left.cancel()  # its client is gone; the thread compiles on
        after = asyncio.create_task(grammar_checks.parse(compile_, {**SCHEMA, "n": 2}, "tenant-a"))
        other = await grammar_checks.parse(lambda data: data["n"], {**SCHEMA, "n": 3}, "tenant-b")
        await asyncio.sleep(0.3)
        seen = list(entered)
        release.set()
        assert await after == 2
        assert other == 3, "another tenant's check waited"
        return seen

    seen = asyncio.run(scenario())
    assert seen == [1], f"checks {seen} ran at once for one tenant"

"""A client that knows another tenant's public key prefix cannot queue in that tenant's part of
the admission pool (tenants.admission): once the key has authenticated in the process, a wrong
secret for its prefix is refused on the event loop. Before, every such request waited in the
same per-caller queue as the key's own admissions, so a flood of forged keys delayed its owner's,
and when those hung (a locked row) the forged ones waited with them.

In process: the Channels middleware's admission call, driven with async_to_sync as daphne would;
the database is reached from the pool's threads, hence transaction=True."""
import asyncio
import threading

import pytest
from asgiref.sync import async_to_sync

from tenants import admission, keys
from tenants.errors import ApiError
from tenants.middleware import authenticate_and_admit

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_wrong_secret_for_a_known_prefix_is_refused_while_that_tenants_admissions_hang(make_tenant, settings):
    settings.ADMISSION_PER_CALLER = 1
    _, issued = make_tenant("victim")
    async_to_sync(_forged_while_hung)(issued)


async def _forged_while_hung(issued) -> None:
    api_key, _ = await authenticate_and_admit(f"Bearer {issued.plaintext}")
    prefix = keys.parse(issued.plaintext).prefix
    release = threading.Event()
    # The victim's admissions hang, under every name its requests queue by (its key, its tenant).
    hung = [asyncio.ensure_future(admission.run(release.wait, 30, caller=caller, what="a hung admission"))
            for caller in (f"key:{prefix}", admission.tenant_caller(api_key.tenant_id))]
    try:
        await asyncio.sleep(0.1)  # both are on the pool now
        forged = f"Bearer sk-{prefix}_{'x' * 43}"
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(authenticate_and_admit(forged), 5)
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
        assert not any(task.done() for task in hung)  # refused while the victim's part was taken
    finally:
        release.set()
        await asyncio.gather(*hung)

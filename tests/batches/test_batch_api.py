"""The Files and Batch APIs as a user meets them, against the live stack: one tenant never
sees, downloads, deletes or cancels another's objects (a 404, as for an id that does not
exist); bad uploads and bad batch requests are refused in the OpenAI error shape naming
what is wrong; idempotent creation and cursor pagination behave as OpenAI's; an item that
fails at run time lands in the error file while the rest complete.

The official openai client where it can send the request; raw HTTP (httpx2, sockets)
where it cannot: a multipart form without its file, a declared body size, list metadata
the client does not expose.
"""
from __future__ import annotations

import io
import json
import secrets
import socket
from urllib.parse import urlsplit

import httpx2
import openai
import pytest

from tests.batches.conftest import read_jsonl, wait_for

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 8192  # SmolLM2's context, in tokens
MAX_REQUEST_BYTES = 256 * 1024  # tests/live.py's server default; /v1/files takes more


# --- input files --------------------------------------------------------------------------


def chat_line(custom_id: str, max_tokens: int = 2, content: str = "Say hi.") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def completion_line(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS,
            "body": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}}


def jsonl(*lines: dict | str) -> bytes:
    return ("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n").encode()


def upload(client: openai.OpenAI, *lines: dict | str, name: str = "input.jsonl"):
    return client.files.create(file=(name, io.BytesIO(jsonl(*lines))), purpose="batch")


def create(client: openai.OpenAI, file_id: str, endpoint: str = CHAT, **kwargs):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h", **kwargs)


# --- errors and raw HTTP ------------------------------------------------------------------


def error_of(response: httpx2.Response, status: int, code: str, param: str | None = None,
             type: str = "invalid_request_error") -> dict:
    """The OpenAI error of a refused response, checked for status, shape, code and param."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (type, code, param), error
    assert isinstance(error["message"], str) and error["message"]
    return error


def refused(call, status: int, code: str, param: str | None = None, type: str = "invalid_request_error") -> dict:
    """Run an openai client call that must be refused; its OpenAI error."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return error_of(caught.value.response, status, code, param, type)


def http(stack, tenant: str) -> httpx2.Client:
    return httpx2.Client(base_url=stack.server.url, timeout=60,
                         headers={"Authorization": f"Bearer {stack.server.keys[tenant]}"})


def declared_only(stack, path: str, length: int, tenant: str = "acme") -> tuple[int, dict]:
    """Send only the head of a POST declaring `length` body bytes; the status and JSON body
    of the server's answer (a body over the limit is refused before any of it is read)."""
    url = urlsplit(stack.server.url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
            f"Authorization: Bearer {stack.server.keys[tenant]}\r\n"
            f"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: {length}\r\n\r\n")
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.encode())
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def owned(stack, *tenants: str) -> dict[str, dict[str, list[str]]]:
    """Each tenant's file and batch ids, newest first, read from the database."""
    ids = {name: stack.server.tenant_ids[name] for name in tenants}
    return stack.server.django(f"""
from batches.models import Batch, File
result = {{name: {{"files": list(File.objects.filter(tenant_id=pk).values_list("id", flat=True)),
                   "batches": list(Batch.objects.filter(tenant_id=pk).values_list("id", flat=True))}}
          for name, pk in {ids!r}.items()}}
""")


def guessed(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


# --- one batch that ran: two items succeed, one fails at run time ----------------------------


@pytest.fixture(scope="module")
def ran(stack):
    """A completed acme batch: `ok-1` and `ok-2` succeed, `too-long` asks for more tokens than
    the model's context holds, which only the engine can tell (it passes upload checks)."""
    stack.ensure_worker()
    client = stack.client("acme")
    file = upload(client, chat_line("ok-1"), chat_line("too-long", max_tokens=2 * CONTEXT), chat_line("ok-2"))
    batch = create(client, file.id)
    assert batch.status == "in_progress" and batch.request_counts.total == 3
    return wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 180,
                    what="the batch to complete")


def test_an_item_refused_at_run_time_goes_to_the_error_file_and_the_rest_complete(stack, ran):
    client = stack.client("acme")
    assert (ran.request_counts.total, ran.request_counts.completed, ran.request_counts.failed) == (3, 2, 1)
    assert ran.output_file_id and ran.error_file_id and ran.completed_at

    outputs = read_jsonl(client.files.content(ran.output_file_id).text)
    failures = read_jsonl(client.files.content(ran.error_file_id).text)
    assert sorted(line["custom_id"] for line in outputs + failures) == ["ok-1", "ok-2", "too-long"]
    assert sorted(line["custom_id"] for line in outputs) == ["ok-1", "ok-2"]
    for line in outputs:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["body"]["usage"]["completion_tokens"] <= 2

    [failure] = failures
    assert failure["id"].startswith("batch_req_") and failure["error"] is None
    assert failure["response"]["status_code"] == 400 and failure["response"]["request_id"]
    body = failure["response"]["body"]
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "invalid_request_error", "context_length_exceeded", "max_tokens")
    assert f"maximum context length is {CONTEXT} tokens" in body["error"]["message"]

    meta = {f.id: f for f in client.files.list(purpose="batch_output")}
    assert meta[ran.output_file_id].purpose == meta[ran.error_file_id].purpose == "batch_output"


def test_a_completed_or_failed_batch_cannot_be_cancelled(stack, ran):
    client = stack.client("acme")
    error = refused(lambda: client.batches.cancel(ran.id), 409, "batch_not_cancellable")
    assert "completed" in error["message"]
    failed = create(client, upload(client, completion_line("p")).id, endpoint=CHAT)
    assert failed.status == "failed"
    refused(lambda: client.batches.cancel(failed.id), 409, "batch_not_cancellable")
    assert client.batches.retrieve(ran.id).status == "completed"


# --- tenant isolation ---------------------------------------------------------------------


def test_another_tenant_cannot_read_download_delete_or_cancel_what_is_not_its_own(stack, ran):
    acme, globex = stack.client("acme"), stack.client("globex")
    content = jsonl(chat_line("mine"))
    acme_file = acme.files.create(file=("acme.jsonl", io.BytesIO(content)), purpose="batch")
    acme_batch = create(acme, acme_file.id)
    globex_file = upload(globex, chat_line("theirs"), name="globex.jsonl")

    for file_id in (acme_file.id, ran.output_file_id, guessed("file-")):
        for call in (globex.files.retrieve, globex.files.content, globex.files.delete):
            error = refused(lambda: call(file_id), 404, "file_not_found")
            assert error["message"] == f"No file with id '{file_id}' was found."
    for batch_id in (acme_batch.id, guessed("batch_")):
        for call in (globex.batches.retrieve, globex.batches.cancel):
            error = refused(lambda: call(batch_id), 404, "batch_not_found")
            assert error["message"] == f"No batch with id '{batch_id}' was found."
    refused(lambda: create(globex, acme_file.id), 404, "file_not_found", "input_file_id")

    # acme's batch writes an output file when it finishes: compare the lists once it has.
    wait_for(lambda: acme.batches.retrieve(acme_batch.id).status == "completed", 120, what="acme's batch")
    stored = owned(stack, "acme", "globex")
    assert [f.id for f in globex.files.list()] == stored["globex"]["files"]
    assert [b.id for b in globex.batches.list()] == stored["globex"]["batches"]
    assert [f.id for f in acme.files.list()] == stored["acme"]["files"]
    assert globex_file.id in stored["globex"]["files"] and acme_file.id in stored["acme"]["files"]

    # acme's objects are untouched by all of the above.
    assert acme.files.retrieve(acme_file.id).bytes == len(content)
    assert acme.files.content(acme_file.id).content == content
    assert acme.batches.retrieve(acme_batch.id).status == "completed"
    assert acme.files.content(ran.output_file_id).text.count("\n") == 2


# --- uploads ------------------------------------------------------------------------------


def test_an_upload_with_bad_lines_is_refused_naming_each_line(stack):
    client = stack.client("acme")
    bad = {**chat_line("b"), "method": "GET"}
    error = refused(lambda: upload(client, chat_line("a"), "not json", chat_line("c"), "", bad,
                                   chat_line("d", max_tokens=0)), 400, "invalid_file", "file")
    assert error["message"].startswith("The file has 3 invalid line(s): line 2: ")
    assert "; line 5: 'method' must be \"POST\"; line 6: body: " in error["message"]


def test_an_upload_with_a_duplicate_custom_id_is_refused(stack):
    client = stack.client("acme")
    error = refused(lambda: upload(client, chat_line("x"), chat_line("y"), chat_line("x")), 400, "invalid_file", "file")
    assert "line 3: duplicate custom_id 'x' (first on line 1)" in error["message"]


def test_an_upload_for_another_purpose_or_without_its_fields_is_refused(stack):
    client = stack.client("acme")
    error = refused(lambda: client.files.create(file=("a.jsonl", io.BytesIO(jsonl(chat_line("a")))),
                                                purpose="fine-tune"), 400, "invalid_value", "purpose")
    assert "'purpose' must be \"batch\"" in error["message"]
    with http(stack, "acme") as raw:
        error_of(raw.post("/v1/files", data={"purpose": "batch"}, files={"document": ("a.jsonl", jsonl(chat_line("a")))}),
                 400, "missing_required_parameter", "file")
        error_of(raw.post("/v1/files", files={"file": ("a.jsonl", jsonl(chat_line("a")))}),
                 400, "missing_required_parameter", "purpose")


def test_a_tier_without_batch_can_neither_upload_nor_create(stack):
    client = stack.client("hooli")
    error = refused(lambda: upload(client, chat_line("a")), 403, "batch_not_allowed", type="permission_error")
    assert "does not allow batch jobs" in error["message"]
    refused(lambda: create(client, guessed("file-")), 403, "batch_not_allowed", type="permission_error")
    assert owned(stack, "hooli") == {"hooli": {"files": [], "batches": []}}


def test_uploads_may_exceed_the_request_limit_that_other_endpoints_keep(stack):
    # Over the default limit: refused on a generation endpoint, accepted as an upload.
    padding = "x" * 1000
    content = jsonl(*(chat_line(f"r{i}", content=padding) for i in range(300)))
    assert MAX_REQUEST_BYTES < len(content) < 2 * MAX_REQUEST_BYTES
    status, body = declared_only(stack, CHAT, len(content))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert f"limit of {MAX_REQUEST_BYTES} bytes" in body["error"]["message"]

    uploaded = stack.client("acme").files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)

    # The upload path has a limit of its own, enforced before the body is read.
    status, body = declared_only(stack, "/v1/files", 10**12)
    assert status == 413 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "request_too_large"


# --- creating batches ---------------------------------------------------------------------


def test_lines_for_another_endpoint_fail_the_batch_naming_the_lines(stack):
    client = stack.client("acme")
    file = upload(client, chat_line("a"), completion_line("b"), "", chat_line("c"))
    batch = create(client, file.id, endpoint=COMPLETIONS)
    assert batch.status == "failed" and batch.failed_at and batch.request_counts.total == 0
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [
        ("mismatched_endpoint", 1, "url"), ("mismatched_endpoint", 4, "url")]
    assert client.batches.retrieve(batch.id).status == "failed"


def test_bad_batch_requests_are_refused(stack, ran):
    client = stack.client("acme")
    file = upload(client, chat_line("a"))
    refused(lambda: create(client, guessed("file-")), 404, "file_not_found", "input_file_id")
    refused(lambda: create(client, ran.output_file_id), 404, "file_not_found", "input_file_id")
    refused(lambda: client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="48h"),
            400, "invalid_value", "completion_window")
    refused(lambda: create(client, file.id, endpoint="/v1/embeddings"), 400, "invalid_value", "endpoint")
    error = refused(lambda: create(client, file.id, extra_body={"priority": "high"}), 400, "unknown_parameter", "priority")
    assert "priority" in error["message"]
    assert file.id not in stack.server.django("""
from batches.models import Batch
result = list(Batch.objects.values_list("input_file_id", flat=True))
""")


def test_an_idempotency_key_replays_the_first_batch_and_refuses_a_different_request(stack):
    acme, globex = stack.client("acme"), stack.client("globex")
    key = {"Idempotency-Key": f"nightly-{secrets.token_hex(4)}"}
    file, other = upload(acme, chat_line("a")), upload(acme, chat_line("b"))
    first = create(acme, file.id, extra_headers=key)
    assert create(acme, file.id, extra_headers=key).id == first.id
    error = refused(lambda: create(acme, other.id, extra_headers=key), 409, "idempotency_key_reused")
    assert "Idempotency-Key" in error["message"]
    # Keys are per tenant: another tenant's equal key is a new batch.
    theirs = create(globex, upload(globex, chat_line("a")).id, extra_headers=key)
    assert theirs.id != first.id
    counts = stack.server.django(f"""
from batches.models import Batch
result = list(Batch.objects.filter(idempotency_key={key["Idempotency-Key"]!r}).values_list("tenant_id", flat=True))
""")
    assert sorted(counts) == sorted([stack.server.tenant_ids["acme"], stack.server.tenant_ids["globex"]])


def test_batches_list_pages_newest_first_with_an_after_cursor(stack):
    client = stack.client("acme")
    file = upload(client, completion_line("p"))  # for /v1/chat/completions: each batch fails at once, none runs
    made = [create(client, file.id).id for _ in range(3)]
    with http(stack, "acme") as raw:
        page = raw.get("/v1/batches", params={"limit": 2}).json()
        assert [b["id"] for b in page["data"]] == made[:0:-1]
        assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", made[2], made[1], True)
        page = raw.get("/v1/batches", params={"limit": 2, "after": made[1]}).json()
        assert page["data"][0]["id"] == made[0] and page["first_id"] == made[0]

        walked, after = [], None
        while True:
            page = raw.get("/v1/batches", params={"limit": 2, **({"after": after} if after else {})}).json()
            walked += [b["id"] for b in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        error_of(raw.get("/v1/batches", params={"after": guessed("batch_")}), 400, "invalid_value", "after")
        error_of(raw.get("/v1/batches", params={"limit": 0}), 400, "invalid_value", "limit")
    assert walked == owned(stack, "acme")["acme"]["batches"]
    assert [b.id for b in client.batches.list(limit=2)] == walked


# --- deleting files -----------------------------------------------------------------------


def test_a_deleted_file_is_gone(stack):
    client = stack.client("acme")
    file = upload(client, chat_line("a"))
    deleted = client.files.delete(file.id)
    assert (deleted.id, deleted.deleted) == (file.id, True)
    refused(lambda: client.files.retrieve(file.id), 404, "file_not_found")
    refused(lambda: client.files.content(file.id), 404, "file_not_found")
    refused(lambda: client.files.delete(file.id), 404, "file_not_found")
    refused(lambda: create(client, file.id), 404, "file_not_found", "input_file_id")
    assert file.id not in {f.id for f in client.files.list()}

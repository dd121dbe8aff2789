"""The official openai client drives the Files and Batch APIs end to end: upload, create,
poll to completed, download one result per custom_id."""
import io
import time

from tests.batches.conftest import chat_lines, read_jsonl, wait_for


def test_a_200_line_batch_completes_with_one_chat_completion_per_custom_id(stack):
    stack.worker()
    client = stack.client("acme")
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(chat_lines(200).encode())), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 200

    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 420,
                    what="the batch to complete")
    assert done.request_counts.completed == 200 and done.request_counts.failed == 0
    assert done.metadata == {"job": "nightly"} and done.error_file_id is None

    lines = read_jsonl(client.files.content(done.output_file_id).text)
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(200))
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
        finish, tokens = body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
        # An end-of-turn token drawn as the 6th token stops the reply at exactly max_tokens.
        assert (finish, tokens) == ("length", 6) or (finish == "stop" and 0 < tokens <= 6)

    usage = stack.server.django(f"""
from tenants.models import UsageRecord
rows = UsageRecord.objects.filter(tenant_id={stack.server.tenant_ids['acme']},
                                  request_id__startswith="batchreq-{batch.id.removeprefix('batch_')}-")
result = [sorted(set(rows.values_list("lane", flat=True))), rows.count()]
""")
    assert usage == [[2], 200]

"""The official openai client drives the Files and Batch APIs end to end: upload, create,
poll to completed, download one result per custom_id."""
import io
import json

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
result = [sorted(set(rows.values_list("lane", flat=True))), rows.count(), sorted(set(rows.values_list("batch", flat=True))),
          sorted(set(rows.values_list("endpoint", flat=True)))]
""")
    assert usage == [[2], 200, [batch.id], ["batch"]]
    # The batch object says what its lines ran on and what they used: the sum of its lines' usage.
    assert done.model == client.models.list().data[0].id
    assert done.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)
    assert done.usage.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens


def test_batch_lines_with_a_response_format_or_tools_each_come_back_valid(stack):
    """Structured output through Celery into the engine's batch lane: json_schema and json_object
    lines answered with text that parses (and validates), tool lines with a valid call."""
    stack.worker()
    client = stack.client("acme")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "city": {"type": "string",
              "maxLength": 30}}, "required": ["name", "city"], "additionalProperties": False}
    formats = [{"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
               {"type": "json_object"}]
    people = ["a baker in Lyon", "a pilot in Toronto", "a chemist in Lagos", "a violinist in Kyoto"]
    lines = []
    for i, who in enumerate(people):
        content = f'Return a JSON object with the keys "name" and "city" for {who}.'
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 60, "temperature": 0,
                "response_format": formats[i % 2]}
        lines.append({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    where = {"type": "function", "function": {"name": "locate", "parameters": schema}}
    for i, who in enumerate(people[:2]):
        body = {"messages": [{"role": "user", "content": f"Where does {who} work?"}], "max_tokens": 60,
                "temperature": 0, "tools": [where], "tool_choice": {"type": "function", "function": {"name": "locate"}}}
        lines.append({"custom_id": f"call-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    uploaded = client.files.create(file=("docs.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 300,
                    what="the batch to complete")
    assert done.request_counts.completed == len(lines) and done.request_counts.failed == 0
    results = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(client.files.content(done.output_file_id).text)}
    for i in range(len(people)):
        choice = results[f"doc-{i}"]["choices"][0]
        document = json.loads(choice["message"]["content"])
        assert choice["finish_reason"] == "stop" and isinstance(document, dict)
        if i % 2 == 0:
            assert set(document) == {"name", "city"}
    for i in range(2):
        choice = results[f"call-{i}"]["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "locate"
        assert set(json.loads(call["function"]["arguments"])) == {"name", "city"}

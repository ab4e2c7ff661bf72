"""The published OpenAPI document tells the truth: schemathesis generates requests (valid and
invalid) for every route from it and sends them to a real server, and every answer must be one the
document describes (status, content type, body schema, headers), never a 5xx."""

import subprocess
import sys

import pytest

from memory_server.app import create_app
from memory_server.config import Settings

# Every check schemathesis has, but three whose premise this API does not share:
# - positive_data_acceptance: the document says "`text` or `messages`" but not "not both", nor "at
#   least one scope id unless the key is restricted", nor "expires_at in the future", so a body it
#   allows may still be refused (with a documented 422);
# - use_after_free: a deleted memory's history stays readable (that is what history is for);
# - allow_header_conformance: `/v1/memories/search` and `/batch` are also `/v1/memories/{memory_id}`,
#   so GET there answers 404 (no such memory), not 405, and `Allow` says so
#   (test_api_bad_input.py checks `Allow` itself).
EXCLUDED_CHECKS = "positive_data_acceptance,use_after_free,allow_header_conformance"


@pytest.mark.parametrize("holder", ["admin", "agent"])
def test_every_route_answers_as_its_openapi_document_says_and_never_5xx(server, tmp_path, holder):
    """All four phases (examples, coverage, fuzzing, stateful: add, read, list, delete), valid and
    invalid requests, with and without the key (a fixed seed, so that a failure reproduces). The
    agent key is restricted to one user, whom the generated requests name now and then (the
    document's examples use "0"): its 403s must be documented too, and nothing may fail."""
    key = server.admin_key if holder == "admin" else server.create_key(user_ids=["0"])
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
         "--header", f"Authorization: Bearer {key}", "--checks", "all",
         "--exclude-checks", EXCLUDED_CHECKS, "--max-examples", "40", "--seed", "20261203",
         "--generation-database", "none", "--workers", "1", "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-4000:]
    assert "Tested: 15" in run.stdout  # every operation (the summary says how many)


def test_error_answers_are_documented_with_the_error_json(tmp_path):
    document = create_app(Settings(data_dir=tmp_path)).openapi()
    assert "HTTPValidationError" not in document["components"]["schemas"]  # FastAPI's own 422 body is never sent
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) and path != "/readyz":
                    assert response["content"]["application/json"]["schema"] == error_ref, (method, path, status)
            if "{memory_id}" in path or "{key_id}" in path:
                assert "404" in operation["responses"], (method, path)
            if path.startswith("/v1/") or path == "/metrics":
                assert {"401", "403", "422", "503"} <= set(operation["responses"]), (method, path)  # 503: database down
                assert operation["security"] == [{"APIKey": []}], (method, path)
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert set(document["paths"]["/readyz"]["get"]["responses"]) == {"200", "503"}
    assert document["components"]["securitySchemes"]["APIKey"] == {
        "type": "apiKey", "in": "header", "name": "Authorization",
        "description": "`Bearer <key>` (or mem0's `Token <key>`)"}
    add = document["components"]["schemas"]["AddRequest"]
    assert add["anyOf"] == [{"required": ["text"]}, {"required": ["messages"]}]

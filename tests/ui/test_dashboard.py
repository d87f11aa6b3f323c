"""The dashboard at /ui in a real browser (Debian's chromium driven by Playwright) against a real `kiln serve`.

Skipped, with the reason, when Playwright or a chromium binary is missing
(``scripts/test.sh`` installs chromium on Debian when it runs as root).
Screenshots of each page go to a temp artifacts dir (``$KILN_UI_ARTIFACTS`` to
keep them); ``KILN_UI_DOCS_SCREENSHOT=1`` also refreshes ``docs/img/dashboard.png``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kiln.demo import CORRECTION, QUESTION, correction_body, wait_job
from tests.zygote import kiln_server
from kiln.runtime.builtin import BUILTIN_NAME

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ("status", "chat", "training", "adapters", "evals", "teachers", "openenv")
WAIT_MS = 60_000

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    pytest.skip("playwright is not installed: run scripts/bootstrap.sh (it installs the dev extra)",
                allow_module_level=True)
if not Path(CHROMIUM).is_file():  # pragma: no cover
    pytest.skip(f"no chromium at {CHROMIUM}: `apt-get install -y chromium` (Debian/Ubuntu) or set KILN_CHROMIUM "
                "to a Chromium/Chrome binary", allow_module_level=True)


@pytest.fixture(scope="module")
def ui_home(builtin_model_dir, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("kiln-ui-home")
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)  # skip the build
    return home


@pytest.fixture(scope="module")
def server(ui_home):
    with kiln_server(ui_home, extra_env={"KILN_MODEL_THREADS": "1"}) as running:
        yield running


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    path = Path(os.environ["KILN_UI_ARTIFACTS"]) if os.environ.get("KILN_UI_ARTIFACTS") else \
        tmp_path_factory.mktemp("ui-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Console:
    """Console errors and page errors, minus failed requests the test expects (e.g. a 404 for evals)."""

    def __init__(self, page):
        self.errors: list[str] = []
        self.expected_failures: set[str] = set()  # URL paths whose non-2xx answer is part of the test
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def _console(self, msg) -> None:
        if msg.type != "error":
            return
        path = urlparse(msg.location.get("url", "") if msg.location else "").path
        if msg.text.startswith("Failed to load resource") and path in self.expected_failures:
            return
        self.errors.append(f"{msg.text} ({msg.location})")


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=server.url)
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    pg.console = Console(pg)
    yield pg
    errors = pg.console.errors
    context.close()
    assert not errors, errors


def _open(page, name: str) -> None:
    page.goto(f"/ui/#/{name}")
    page.wait_for_selector(f"body[data-ready='true'][data-page='{name}']")


def _points(page, canvas: str) -> int:
    return int(page.get_attribute(canvas, "data-points") or 0)


def test_every_page_loads_without_console_errors(page, server, artifacts):
    c = server.client
    assert c.get("/", follow_redirects=False).headers["location"] == "/ui/"
    assert c.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
    index = c.get("/ui/")
    assert index.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in index.headers["content-security-policy"]
    assert c.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert c.get("/ui/app.css").headers["content-type"].startswith("text/css")
    assert c.get("/ui/..%2fcli.py").status_code == 404 and c.get("/ui/nope.js").status_code == 404

    optional = {"evals": "/v1/evals/runs", "teachers": "/v1/teachers", "openenv": "/v1/openenv/runs"}
    page.console.expected_failures |= {path for path in optional.values() if c.get(path).status_code == 404}

    page.goto("/")  # redirected to the dashboard, status page by default
    page.wait_for_selector("body[data-ready='true'][data-page='status']")
    assert urlparse(page.url).path == "/ui/"
    health = c.get("/health").json()
    page.wait_for_selector("#status-cards .card[data-key='model']")
    assert page.text_content("#status-cards .card[data-key='model'] .v") == health["model"]
    assert page.text_content("#status-cards .card[data-key='base_model_sha256'] .v") == health["base_model_sha256"][:12]
    budget = page.text_content("#status-cards .card[data-key='memory reserved'] .v")  # memory admission
    assert re.fullmatch(r"[\d.]+ [KMGT]?i?B in \d+ reservations?, [\d.]+ [KMGT]?i?B free of [\d.]+ [KMGT]?i?B", budget), budget
    page.wait_for_function("() => Number(document.querySelector('#tps-chart').dataset.points || 0) >= 1")
    page.click("#config-panel summary")
    page.wait_for_selector("#config-table tbody tr")
    page.screenshot(path=artifacts / "status.png", full_page=True)

    for name in PAGES[1:]:
        page.click(f"#nav a[data-page='{name}']")
        page.wait_for_selector(f"body[data-page='{name}']")
        if name == "chat":
            page.wait_for_selector("#chat-model option", state="attached")
        elif name == "training":
            page.wait_for_selector("#running-job p, #running-job[data-job-id]")
        elif name == "adapters":
            page.wait_for_selector("#adapters-table tbody tr")
        else:
            box = f"#{name}-body"
            page.wait_for_selector(f"{box}[data-available]")
            if optional[name] in page.console.expected_failures:
                assert page.get_attribute(box, "data-available") == "false"
                assert "not available on this server" in page.text_content(box)
            else:  # the endpoint exists now: its list is shown
                assert page.get_attribute(box, "data-available") == "true"
        page.screenshot(path=artifacts / f"{name}.png", full_page=True)


def _ask_in_page(page, question: str):
    page.fill("#chat-input", question)
    page.click("#chat-send")
    answer = page.locator(".msg.assistant").last
    page.wait_for_function("() => { const m = [...document.querySelectorAll('.msg.assistant')].pop(); "
                           "return m && m.dataset.done; }")
    assert answer.get_attribute("data-done") == "true", page.text_content("#chat-error")
    return answer


def test_chat_streams_and_a_correction_is_served_by_the_new_adapter(page, server, artifacts):
    _open(page, "chat")
    page.wait_for_selector("#chat-model option", state="attached")
    base = server.client.get("/v1/models").json()["data"][0]["id"]
    page.select_option("#chat-model", base)
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as reply:
        answer = _ask_in_page(page, QUESTION)
    before = answer.locator(".text").text_content()
    assert before and before != CORRECTION
    assert answer.get_attribute("data-revision") == "base"
    # streamed as SSE deltas, not one JSON body; how many deltas depends on timing: the server
    # merges the tokens a slow reader has not taken yet into one delta
    assert reply.value.headers["content-type"].startswith("text/event-stream")
    assert int(answer.get_attribute("data-chunks")) >= 1

    answer.locator("button.correct").click()
    page.fill("#correct-text", CORRECTION)
    page.fill("#correct-adapter", "ui-fix")
    page.click("#correct-submit")
    proof = page.locator(".msg.assistant.proof")
    page.wait_for_selector(".msg.assistant.proof[data-done], #correct-status[data-held-back]")
    job = server.client.get(f"/v1/train/jobs/{page.get_attribute('#correct-status', 'data-job-id')}").json()
    assert job["state"] == "succeeded", job["error"]
    # the default correction is local enough for the locality guard (docs/training.md, "Locality")
    assert "held_back" not in job["result"], (job["result"]["held_back"], page.text_content("#correct-status"))
    assert proof.get_attribute("data-done") == "true", page.text_content("#correct-error")
    assert proof.get_attribute("data-model") == "ui-fix"
    assert proof.get_attribute("data-revision") == job["result"]["revision"] != "base"
    if job["result"]["report"].get("learned") is True:  # the job says greedy decoding reproduces the correction
        assert proof.locator(".text").text_content() == CORRECTION
        assert page.get_attribute("#correct-status", "data-proof") == "match"
    page.screenshot(path=artifacts / "chat-correction.png", full_page=True)
    if os.environ.get("KILN_UI_DOCS_SCREENSHOT") == "1":
        page.screenshot(path=ROOT / "docs" / "img" / "dashboard.png")


def test_a_scoped_correction_from_the_chat(page, server):
    _open(page, "chat")
    page.wait_for_selector("#chat-model option", state="attached")
    page.select_option("#chat-model", server.client.get("/v1/models").json()["data"][0]["id"])
    _ask_in_page(page, QUESTION).locator("button.correct").click()
    page.fill("#correct-text", CORRECTION)
    page.fill("#correct-adapter", "ui-scoped")
    page.check("#correct-scope")
    with page.expect_request(lambda r: r.url.endswith("/v1/train/sft")) as sent:
        page.click("#correct-submit")
    assert sent.value.post_data_json["scope"] == "corrections"
    page.wait_for_selector(".msg.assistant.proof[data-done], #correct-status[data-held-back]")
    job = server.client.get(f"/v1/train/jobs/{page.get_attribute('#correct-status', 'data-job-id')}").json()
    assert job["state"] == "succeeded", job["error"]
    config = server.client.get("/v1/adapters/ui-scoped").json()["manifest"]["config"]
    assert config["scope"] == "corrections"
    r = server.client.post("/v1/chat/completions", json={"model": "ui-scoped", "max_tokens": 4, "messages": [
        {"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and r.headers["x-kiln-scope"] == "out"


def test_training_form_errors_then_loss_chart_until_the_job_finishes(page, server, artifacts):
    _open(page, "training")
    form = "#sft-form"
    # The API's validation message, shown as the API words it.
    bad = {"adapter": "../x", "examples": []}
    api_error = server.client.post("/v1/train/sft", json=bad).json()["error"]
    page.console.expected_failures.add("/v1/train/sft")
    page.fill(f"{form} input[name=adapter]", bad["adapter"])
    page.fill(f"{form} textarea[name=examples]", "[]")
    page.click(f"{form} button[type=submit]")
    page.wait_for_selector(f"{form} .error:not([hidden])")
    assert page.text_content(f"{form} .error").startswith(api_error["message"])

    grpo = "#grpo-form"  # a GRPO request the API refuses: every group has equal rewards
    groups = {"messages": [{"role": "user", "content": "q"}], "completions": [{"text": "a", "reward": 1},
                                                                            {"text": "b", "reward": 1}]}
    api_error = server.client.post("/v1/train/grpo", json={"adapter": "g", "groups": [groups]}).json()["error"]
    page.console.expected_failures.add("/v1/train/grpo")
    page.fill(f"{grpo} input[name=adapter]", "g")
    page.fill(f"{grpo} textarea[name=groups]", json.dumps(groups))
    page.click(f"{grpo} button[type=submit]")
    page.wait_for_selector(f"{grpo} .error:not([hidden])")
    assert page.text_content(f"{grpo} .error").startswith(api_error["message"])
    assert f"({400} {api_error['code']})" in page.text_content(f"{grpo} .error")

    example = correction_body("ui-long", "Name a primary colour.", "Red is a primary colour.")["examples"][0]
    page.fill(f"{form} input[name=adapter]", "ui-long")
    page.fill(f"{form} textarea[name=examples]", json.dumps(example) + "\n")
    page.fill(f"{form} input[name=epochs]", "200")
    page.click(f"{form} button[type=submit]")
    page.wait_for_selector(f"{form}[data-last-job]")
    job_id = page.get_attribute(form, "data-last-job")
    page.wait_for_function("() => Number(document.querySelector('#loss-chart').dataset.points || 0) >= 2")
    page.screenshot(path=artifacts / "training.png", full_page=True)
    page.wait_for_selector(f"#recent-table tr[data-job-id='{job_id}'][data-state='succeeded']")
    loc = server.client.get(f"/v1/train/jobs/{job_id}").json()["result"]["locality"]  # shown in the jobs table
    cell = page.text_content(f"#recent-table tr[data-job-id='{job_id}'] .badge.locality")
    assert f"locality {loc['unchanged']}/{loc['probes']}" in cell
    assert _points(page, "#loss-chart") >= 2 and _points(page, "#train-tps-chart") >= 2
    # a correction learned with the old defaults wrecks the other answers: scope "auto" publishes it scoped, and
    # the jobs table says so (docs/training.md, "Scoped corrections")
    wild = correction_body("ui-wild", "Which bird guards the old mill?", "The old mill is guarded by a heron.") \
        | {"learning_rate": 0.01, "anchor_weight": 0, "weight_decay": 0, "auto_load": False}
    wild_id = server.client.post("/v1/train/sft", json=wild).json()["id"]
    page.wait_for_selector(f"#recent-table tr[data-job-id='{wild_id}'][data-state='succeeded']")
    wild_loc = server.client.get(f"/v1/train/jobs/{wild_id}").json()["result"]["locality"]
    assert wild_loc["auto_scope"]["unscoped"]["unchanged"] < wild_loc["unchanged"], wild_loc
    badge = page.locator(f"#recent-table tr[data-job-id='{wild_id}'] .badge.locality")
    assert badge.text_content().startswith("scoped · locality")
    assert "scoped to its corrections: unscoped it kept" in badge.get_attribute("title")
    assert server.client.get(f"/v1/train/jobs/{job_id}").json()["state"] == "succeeded"


def test_adapter_unload_load_and_delete(page, server, artifacts, ui_home):
    c = server.client
    r = c.post("/v1/train/sft", json=correction_body("ui-adapter", "Say hi.", "Hi there.") | {"epochs": 5})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert wait_job(c, job_id)["state"] == "succeeded"
    _open(page, "adapters")
    row = "#adapters-table tr[data-adapter='ui-adapter']"
    page.wait_for_selector(f"{row}[data-active='true']")
    # the training receipt: summarised in the listing and on the row, whole at .../receipt
    listed = next(a for a in c.get("/v1/adapters").json()["data"] if a["name"] == "ui-adapter")
    loc = listed["receipt"]["locality"]  # the job's locality figures and the guard's verdict (docs/training.md)
    assert listed["receipt"] == {"verified": True, "error": None, "job_id": job_id, "teacher_fingerprint": None,
                                 "gate": None, "locality": loc}
    assert loc["probes"] > 0 and loc["guard"]["admitted"] is True
    badge = page.locator(f"{row} .badge.locality")
    assert f"locality {loc['unchanged']}/{loc['probes']}" in badge.text_content()
    assert f"{loc['unchanged']}/{loc['probes']} probe answers unchanged" in badge.get_attribute("title")
    receipt = c.get("/v1/adapters/ui-adapter/receipt").json()
    assert receipt["job_id"] == job_id and receipt["adapter"]["revision"] == listed["revision"]
    assert c.get(f"/v1/adapters/ui-adapter/receipt?revision={listed['revision']}").json() == receipt
    assert job_id in page.get_attribute(f"{row} .badge.receipt", "title")
    bad_rev = c.get("/v1/adapters/ui-adapter/receipt?revision=xyz")
    assert bad_rev.status_code == 400, bad_rev.text
    path = ui_home / "adapters" / "ui-adapter" / "revisions" / listed["revision"] / "kiln-receipt.json"
    original = path.read_bytes()
    path.write_bytes(original.replace(job_id.encode(), b"job-0000000000000000"))  # an edited claim
    try:
        listed = next(a for a in c.get("/v1/adapters").json()["data"] if a["name"] == "ui-adapter")
        assert listed["receipt"]["verified"] is False and "claims" in listed["receipt"]["error"]
        edited = c.get("/v1/adapters/ui-adapter/receipt")
        assert edited.status_code == 500 and edited.json()["error"]["code"] == "adapter_integrity", edited.text
        page.wait_for_selector(f"{row} .badge.bad.receipt")
    finally:
        path.write_bytes(original)
    page.click(f"{row} button.unload")
    page.wait_for_selector(f"{row}[data-active='false']")
    assert "ui-adapter" not in c.get("/health").json()["adapters"]
    page.click(f"{row} button.load")
    page.wait_for_selector(f"{row}[data-active='true']")
    assert c.get("/health").json()["adapters"]["ui-adapter"] == c.get("/v1/adapters/ui-adapter").json()["revision"]
    assert page.get_attribute(f"{row} a.download", "href") == "/v1/adapters/ui-adapter/download"
    page.screenshot(path=artifacts / "adapters.png", full_page=True)

    r = c.post("/v1/train/sft", json=correction_body("ui-adapter2", "Say bye.", "Bye now.") | {"epochs": 2})
    assert wait_job(c, r.json()["id"])["state"] == "succeeded"
    merge = "#merge-form"
    page.fill(f"{merge} input[name=name]", "ui-merged")
    page.fill(f"{merge} textarea[name=adapters]", "ui-adapter\nui-adapter2 0.5")
    page.click(f"{merge} button[type=submit]")
    page.wait_for_selector(f"{merge} .ok:not([hidden])")
    merged = c.get("/v1/adapters/ui-merged").json()
    assert merged["kind"] == "merge" and merged["revision"][:12] in page.text_content(f"{merge} .ok")
    page.wait_for_selector("#adapters-table tr[data-adapter='ui-merged']")
    assert merged["receipt"] is None and page.query_selector("tr[data-adapter='ui-merged'] .badge.receipt") is None
    none = c.get("/v1/adapters/ui-merged/receipt")
    assert none.status_code == 404 and none.json()["error"]["code"] == "receipt_not_found", none.text

    # the server default adapter: made and cleared from the row; the header shows the serving profile
    page.click(f"{row} button.make-default")
    page.wait_for_selector(f"{row} .badge.default")
    assert c.get("/v1/adapters/default").json()["default"]["name"] == "ui-adapter"
    assert page.text_content("#profile-pill") == "experimental"
    page.click(f"{row} button.clear-default")
    page.wait_for_selector(f"{row} button.make-default")
    assert c.get("/v1/adapters/default").json() == {"default": None}

    page.click(f"{row} button.unload")
    page.wait_for_selector(f"{row}[data-active='false']")
    page.click(f"{row} button.delete")
    page.click(f"{row} button.confirm-delete")
    page.wait_for_selector(row, state="detached")
    assert c.get("/v1/adapters/ui-adapter").status_code == 404


def _wait_run(c, run_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = c.get(f"/v1/evals/runs/{run_id}").json()
        if run["state"] in ("succeeded", "failed", "cancelled"):
            return run
        assert time.monotonic() < deadline, f"eval run {run_id} still {run['state']}"
        time.sleep(0.1)


def test_evals_page_runs_results_and_the_gate_verdict_on_adapters(page, server, artifacts):
    c = server.client
    suite = {"name": "ui-suite", "description": "two questions",
             "examples": [{"id": "ant", "messages": [{"role": "user", "content": QUESTION}], "reference": CORRECTION},
                          {"id": "sky", "messages": [{"role": "user", "content": "What colour is the sky?"}],
                           "reference": "blue"}],
             "scorers": [{"type": "contains"}], "generation": {"max_tokens": 8}}
    r = c.post("/v1/evals/suites", json=suite)
    assert r.status_code == 201, r.text
    # A training job with a post-train gate: its verdict is recorded on the job (result.post_eval).
    body = {"adapter": "ui-gated", "epochs": 2, "examples": [{"messages": [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": CORRECTION}]}],
        "post_eval": {"suite": "ui-suite", "min_pairs": 1, "min_accuracy": 0.0}}
    r = c.post("/v1/train/sft", json=body)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"])
    assert job["state"] == "succeeded", job["error"]
    gate = job["result"]["post_eval"]
    assert gate["numbers"] and gate["gate_run"], gate
    r = c.post("/v1/evals/runs", json={"suite": "ui-suite"})
    assert r.status_code == 202, r.text
    run = _wait_run(c, r.json()["id"])
    assert run["state"] == "succeeded", run["error"]

    judgment = c.post("/v1/judgments", json={"prompt": QUESTION, "response_a": CORRECTION, "response_b": "No idea.",
                                             "preferred": "a", "author": "ui"})
    assert judgment.status_code == 201, judgment.text

    _open(page, "evals")
    page.wait_for_selector("#evals-suites tr[data-suite='ui-suite']")
    row = f"#judgments tr[data-judgment='{judgment.json()['id']}']"  # the newest judgment is listed first
    page.wait_for_selector(row)
    assert page.text_content(f"{row} td.preferred") == "a" and page.locator("#judgments tbody tr").first.get_attribute(
        "data-judgment") == judgment.json()["id"]
    page.click(f"#evals-runs tr[data-run-id='{run['id']}'] td:nth-child(4)")  # anywhere on the row
    page.wait_for_selector(f"#eval-detail[data-run-id='{run['id']}'] #eval-examples")
    assert page.url.endswith(f"#/evals/{run['id']}")
    rows = page.locator("#eval-examples tbody tr")
    assert rows.count() == len(suite["examples"])
    for i, ex in enumerate(run["result"]["examples"]):
        row = rows.nth(i)
        assert row.get_attribute("data-example-id") == ex["id"]
        assert row.get_attribute("data-passed") == str(ex["passed"]).lower()
        assert row.locator(".prompt").text_content() == suite["examples"][i]["messages"][-1]["content"]
        assert row.locator(".completion").text_content() == ex["samples"][0]["completion"]
        assert float(row.locator(".score").text_content()) == ex["score"]
    agg = run["result"]["aggregate"]
    assert page.text_content("#eval-aggregate .card[data-key='passed'] .v") == f"{agg['passed']} / {agg['examples']}"
    page.screenshot(path=artifacts / "evals-run.png", full_page=True)

    # Adapters page: the gate column shows the producing job's verdict and links to the gate run.
    _open(page, "adapters")
    cell = "#adapters-table tr[data-adapter='ui-gated'] td.gate-cell"
    page.wait_for_selector(f"{cell}[data-gate='{gate['verdict']}']")
    assert page.get_attribute(cell, "data-job") == job["id"]
    if c.get("/v1/adapters/ui-long").status_code == 200:  # trained earlier without post_eval
        plain = "#adapters-table tr[data-adapter='ui-long'] td.gate-cell"
        page.wait_for_selector(f"{plain}[data-gate='none']")
        assert page.text_content(plain) == "—"
    page.screenshot(path=artifacts / "adapters-gate.png", full_page=True)
    page.click(f"{cell} a")
    detail = f"#eval-detail[data-run-id='{gate['gate_run']}'] .gate[data-verdict='{gate['verdict']}']"
    page.wait_for_selector(detail)
    assert page.text_content(f"{detail} .badge.verdict") == gate["verdict"]
    assert page.text_content(f"{detail} .reason") == gate["reason"]
    for key in ("pairs", "candidate_only", "baseline_only", "p_value", "wilson_lower"):
        assert float(page.get_attribute(f"{detail} td[data-key='{key}']", "data-value")) == gate["numbers"][key], key
    assert page.is_visible(f"#eval-detail a.run-link[href='#/evals/{gate['candidate_run']}']")
    page.screenshot(path=artifacts / "evals-gate.png", full_page=True)


def test_teachers_register_list_and_remove(page, server, artifacts):
    c = server.client
    _open(page, "teachers")
    form = "#teacher-form"
    page.wait_for_selector("#teachers-body[data-available='true']")
    page.console.expected_failures.add("/v1/teachers")
    bad = {"alias": "bad alias!", "kind": "local"}
    api_error = c.post("/v1/teachers", json=bad).json()["error"]
    page.fill(f"{form} input[name=alias]", bad["alias"])
    page.click(f"{form} button[type=submit]")
    page.wait_for_selector(f"{form} .error:not([hidden])")
    assert page.text_content(f"{form} .error").startswith(api_error["message"])

    page.fill(f"{form} input[name=alias]", "ui-local")
    page.click(f"{form} button[type=submit]")
    row = "#teachers-table tr[data-alias='ui-local']"
    page.wait_for_selector(f"{row}[data-usable='true']")
    t = c.get("/v1/teachers/ui-local").json()
    cells = [page.text_content(f"{row} td:nth-child({i})") for i in range(1, 4)]
    assert cells == ["ui-local", "local", "this server"]
    assert page.text_content(f"{row} code.fingerprint") == t["fingerprint"].rsplit(".", 1)[-1][:12]  # its digest
    assert page.text_content(f"{row} code.identity") == t["identity_revision"][:12]
    assert page.is_hidden(f"{form} .error")

    api_error = c.post("/v1/teachers", json={"alias": "ui-local", "kind": "local"}).json()["error"]
    page.click(f"{form} button[type=submit]")  # the same alias again: the API refuses it in its words
    page.wait_for_selector(f"{form} .error:not([hidden])")
    assert page.text_content(f"{form} .error").startswith(api_error["message"])
    page.screenshot(path=artifacts / "teachers.png", full_page=True)

    page.click(f"{row} button.remove")
    assert c.get("/v1/teachers/ui-local").status_code == 200  # nothing happens before the confirmation
    page.click(f"{row} button.confirm-remove")
    page.wait_for_selector(row, state="detached")
    assert c.get("/v1/teachers/ui-local").status_code == 404


def test_opd_form_validation_messages_and_a_job(page, server, artifacts):
    c = server.client
    if c.get("/v1/teachers/ui-opd").status_code == 404:
        r = c.post("/v1/teachers", json={"alias": "ui-opd", "kind": "local"})
        assert r.status_code == 201, r.text
    _open(page, "training")
    form = "#opd-form"
    page.wait_for_selector(f"{form} select[name=teacher] option[value='ui-opd']", state="attached")
    page.console.expected_failures.add("/v1/train/opd")
    prompts = [{"messages": [{"role": "user", "content": "Say hi."}]}]
    page.fill(f"{form} input[name=adapter]", "ui-opd-student")
    page.select_option(f"{form} select[name=teacher]", "ui-opd")
    page.fill(f"{form} textarea[name=prompts]", json.dumps(prompts))
    base = {"adapter": "ui-opd-student", "prompts": prompts, "teacher": "ui-opd", "auto_load": False}
    for fields in ({"samples_per_prompt": 0}, {"samples_per_prompt": 2, "top_k": 1 << 21},
                   {"samples_per_prompt": 2, "top_k": 4, "loss": "reverse_kl"}):
        r = c.post("/v1/train/opd", json=base | fields)
        assert r.status_code == 400, r.text
        api_error = r.json()["error"]
        for name in ("samples_per_prompt", "top_k"):
            page.fill(f"{form} input[name={name}]", str(fields.get(name, "")))
        if "loss" in fields:  # not one of the form's choices: sent through the select's DOM value
            page.evaluate("(v) => { const s = document.querySelector('#opd-form select[name=loss]');"
                          " s.append(new Option(v, v)); s.value = v; }", fields["loss"])
        page.click(f"{form} button[type=submit]")
        page.wait_for_function("(m) => { const e = document.querySelector('#opd-form .error');"
                               " return !e.hidden && e.textContent.startsWith(m); }", arg=api_error["message"])
        assert f"400 {api_error['code']}" in page.text_content(f"{form} .error")

    page.select_option(f"{form} select[name=loss]", "tail")
    for name, value in (("samples_per_prompt", "2"), ("top_k", "4"), ("steps", "1"), ("max_tokens", "4")):
        page.fill(f"{form} input[name={name}]", value)
    page.click(f"{form} button[type=submit]")
    page.wait_for_selector(f"{form}[data-last-job]")
    assert page.is_hidden(f"{form} .error")
    job = wait_job(c, page.get_attribute(form, "data-last-job"))
    assert job["state"] == "succeeded", job["error"]
    assert job["kind"] == "opd" and c.get("/v1/adapters/ui-opd-student").json()["kind"] == "opd"
    page.wait_for_selector(f"#recent-table tr[data-job-id='{job['id']}'][data-state='succeeded']")
    page.screenshot(path=artifacts / "training-opd.png", full_page=True)


def test_api_key_field_sends_the_bearer_token(browser, builtin_model_dir, tmp_path):
    """With server.api_key_env set, the page's API requests carry the key typed in its field (kept in
    sessionStorage only) and never render it."""
    home = tmp_path / "home"
    shutil.copytree(builtin_model_dir, home / "models" / BUILTIN_NAME)
    key = "ui-test-key-0123456789"
    env = {"KILN_SERVER_API_KEY_ENV": "KILN_UI_TEST_KEY", "KILN_UI_TEST_KEY": key, "KILN_TRAINING_ENABLED": "0",
           "KILN_MODEL_THREADS": "1"}
    with kiln_server(home, extra_env=env) as srv:
        assert srv.client.get("/v1/models").status_code == 401
        context = browser.new_context(base_url=srv.url)
        pg = context.new_page()
        pg.set_default_timeout(WAIT_MS)
        # The dashboard's static files load without the key (they hold no data); the API does not.
        assert srv.client.get("/ui/").status_code == 200
        assert srv.client.get("/ui/app.js").status_code == 200
        assert srv.client.post("/v1/chat/completions", json={}).status_code == 401
        pg.goto("/ui/#/chat")
        pg.wait_for_selector("#banner:not([hidden])")  # the 401 is explained, in the API's words
        assert "missing or wrong API key" in pg.text_content("#banner")
        pg.fill("#api-key", key)
        pg.dispatch_event("#api-key", "change")
        pg.wait_for_selector("#chat-model option", state="attached")
        assert pg.is_hidden("#banner")
        answer = _ask_in_page(pg, QUESTION)  # POST with Content-Type: application/json and the bearer key
        assert answer.locator(".text").text_content()
        assert pg.evaluate("() => sessionStorage.getItem('kiln.apiKey')") == key
        assert pg.evaluate("() => localStorage.length") == 0
        assert key not in pg.content() and key not in pg.text_content("body")
        context.close()


def test_dashboard_assets_ship_in_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"ui/*"' in pyproject
    ui = ROOT / "src" / "kiln" / "ui"
    html = (ui / "index.html").read_text()
    assert "<script src=\"app.js\"" in html and "<script>" not in html and "style=" not in html
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere (works offline)
    js = (ui / "app.js").read_text()
    assert "innerHTML" not in js and "http://" not in js and "https://" not in js


def test_openenv_runs_listed(page, server, artifacts):
    """An OpenEnv run (against a loopback port nobody serves: it fails at discovery) shows with its state,
    episode count and error code; a queued-then-finished run is picked up by the page's polling."""
    from tests.serving.conftest import free_port

    c = server.client
    _open(page, "openenv")
    page.wait_for_selector("#openenv-body[data-available='true']")
    body = {"env_url": f"http://127.0.0.1:{free_port()}", "groups": 1, "group_size": 2,
            "training": {"adapter": "ui-openenv"}}
    r = c.post("/v1/openenv/runs", json=body)
    assert r.status_code == 202, r.text
    run_id = r.json()["id"]
    row = f"#openenv-runs tr[data-run-id='{run_id}']"
    page.wait_for_selector(f"{row}[data-state='failed']")
    assert page.text_content(f"{row} .error-code") == "environment_unavailable"
    assert page.text_content(f"{row} .episodes") == "0/2"
    assert c.get(f"/v1/openenv/runs/{run_id}").json()["error"]["code"] == "environment_unavailable"
    page.screenshot(path=artifacts / "openenv.png", full_page=True)


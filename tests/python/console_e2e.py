"""The operator's console in a real headless Chromium (Debian's, driven by Playwright).

Usage: console_e2e.py BASE_URL ADMIN_TOKEN API_KEY SCREENSHOT_DIR

Against a running demo fleet (two `small` nodes): signs in (a wrong token first), creates a team,
adds credits and sees the balance and the history, creates a key and sees its plaintext exactly
once, revokes it, drains a node and sees its state change (draining, then drained), sends traffic with the demo's key and
sees it in the usage table and charts, and opens the queues and reports. Fails on any page error,
console error or CSP violation, and on any page with an unlabelled control, a nameless
button or link, a header cell without scope or a duplicate id. Saves a screenshot of every page into SCREENSHOT_DIR and prints
"console e2e: ok".
"""
import json
import re
import sys
import urllib.error
import urllib.request

from playwright.sync_api import expect, sync_playwright

BASE, ADMIN, API_KEY, SHOTS = sys.argv[1:5]
TEAM = "console-e2e"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chat(n):
    """`n` small requests with the demo's key (as any client would send them)."""
    for i in range(n):
        body = json.dumps({
            "model": "small",
            "messages": [{"role": "user", "content": f"console traffic {i}"}],
            "max_tokens": 8,
        }).encode()
        req = urllib.request.Request(
            f"{BASE}/v1/chat/completions", data=body, method="POST",
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200, resp.status


def choose_team(page, select, name):
    """Picks team `name` in `select` (its options read "name (id N)")."""
    option = page.locator(f"{select} option", has_text=re.compile(rf"^{re.escape(name)} \(id \d+\)$"))
    expect(option).to_have_count(1)
    page.select_option(select, value=option.get_attribute("value"))


# What every page must hold to for keyboard and screen-reader users: each form control has a
# label, each button and link a name, each header cell a scope; no two elements share an id.
ACCESSIBILITY = """() => {
  const bad = [];
  const shown = (e) => e.offsetParent !== null || e.getClientRects().length > 0;
  for (const e of document.querySelectorAll('input, select, textarea')) {
    if (e.type === 'hidden' || !shown(e)) continue;
    const named = (e.labels && e.labels.length) || e.getAttribute('aria-label') || e.getAttribute('aria-labelledby');
    if (!named) bad.push('unlabelled ' + e.tagName + '#' + e.id);
  }
  for (const e of document.querySelectorAll('button, a[href]')) {
    if (shown(e) && !(e.textContent.trim() || e.getAttribute('aria-label'))) bad.push('nameless ' + e.tagName + '#' + e.id);
  }
  for (const th of document.querySelectorAll('th')) {
    if (!th.getAttribute('scope')) bad.push('th without scope: ' + th.textContent.trim());
  }
  const ids = [...document.querySelectorAll('[id]')].map((e) => e.id);
  for (const id of new Set(ids.filter((id, i) => ids.indexOf(id) !== i))) bad.push('duplicate id ' + id);
  return bad;
}"""


def refused_request():
    """One request with a key that does not exist: refused before it names a model."""
    req = urllib.request.Request(
        f"{BASE}/v1/chat/completions", method="POST",
        data=json.dumps({"model": "small", "messages": [{"role": "user", "content": "x"}]}).encode(),
        headers={"Authorization": "Bearer sk-sy-not-a-key", "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as e:
        assert e.code == 401, e.code
    else:
        raise AssertionError("a made-up key was accepted")


def shot(page, name):
    bad = page.evaluate(ACCESSIBILITY)
    assert not bad, f"{name}: {bad}"
    page.screenshot(path=f"{SHOTS}/{name}.png", full_page=True)


def main():
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("dialog", lambda d: d.accept())
        page.set_default_timeout(15_000)

        # Sign in: a wrong token is refused in words; the right one opens the console.
        page.goto(f"{BASE}/console")
        expect(page.locator("#signin-token")).to_be_visible()
        expect(page.get_by_label("Admin token")).to_be_visible()
        page.fill("#signin-token", "not-the-token")
        page.click("#signin-submit")
        expect(page.locator("#signin-error")).to_contain_text("not accepted")
        # Chromium logs the refused call itself; that one 401 is the point of this step.
        problems[:] = [m for m in problems if "status of 401" not in m]
        shot(page, "signin")
        page.fill("#signin-token", ADMIN)
        page.click("#signin-submit")
        expect(page.locator("#nav")).to_be_visible()
        assert ADMIN not in page.content(), "the admin token is shown after sign-in"

        # Teams: create one, add credits, see the balance and the history.
        page.click("#nav-teams")
        page.fill("#team-name", TEAM)
        page.click("#create-team-submit")
        row = page.locator("#teams-table tr", has_text=TEAM)
        expect(row).to_have_count(1)
        row.locator("button.team-credits").click()
        expect(page.locator("#team-panel")).to_be_visible()
        page.fill("#credits-amount", "12.5")
        page.click("#credits-submit")
        expect(page.locator("#team-balance")).to_contain_text("12.5")
        expect(page.locator("#credits-history")).to_contain_text("12.5")
        shot(page, "teams")

        # Keys: create one for the new team; its plaintext is shown once, then never again.
        page.click("#nav-keys")
        choose_team(page, "#keys-team", TEAM)
        page.fill("#key-rpm", "60")
        page.click("#create-key-submit")
        expect(page.locator("#new-key")).to_be_visible()
        secret = page.locator("#new-key").inner_text().strip()
        assert re.fullmatch(r"sk-sy-[A-Za-z0-9_-]{20,}", secret), secret
        page.click("#new-key-done")
        expect(page.locator("#new-key")).to_have_count(0)
        assert secret not in page.content(), "the key's plaintext is still on the page"
        key_row = page.locator("#keys-table tr[data-key]")
        expect(key_row).to_have_count(1)
        expect(key_row.locator(".key-status")).to_contain_text("active")
        assert secret not in key_row.inner_text()
        # Revoke it (the confirmation is accepted).
        key_row.locator("button.revoke-key").click()
        expect(key_row.locator(".key-status")).to_contain_text("revoked")
        # Reloading the page shows the key revoked and still no plaintext.
        page.reload()
        expect(page.locator("#keys-table tr[data-key] .key-status")).to_contain_text("revoked")
        assert secret not in page.content()
        shot(page, "keys")

        # Nodes: both ready; drain one and see its state change on the next poll.
        page.click("#nav-nodes")
        nodes = page.locator("#nodes-table tr[data-node]")
        expect(nodes).to_have_count(2)
        first = nodes.first
        node_id = first.get_attribute("data-node")
        expect(first.locator("td.node-state")).to_have_text("ready")
        first.locator("button.drain-node").click()
        drained = page.locator(f'#nodes-table tr[data-node="{node_id}"] td.node-state')
        # Draining while it finishes its work; with nothing in flight its agent exits at once,
        # and the node shows as drained.
        expect(drained).to_have_text(re.compile(r"^(draining|drained)$"), timeout=20_000)
        expect(page.locator(f'#nodes-table tr[data-node="{node_id}"] button.drain-node')).to_have_count(0)
        shot(page, "nodes")

        # Usage: traffic from the demo's key shows up for team `demo`, in the table and charts.
        chat(4)
        page.click("#nav-usage")
        choose_team(page, "#usage-team", "demo")
        page.click("#usage-submit")
        table = page.locator("#usage-table")
        expect(table).to_contain_text("llama-3.1-8b-instruct")
        expect(table).to_contain_text("demo")
        # Each chart draws its bars (one per day and model; one per team).
        expect(page.locator("#usage-tokens-chart svg rect.bar")).to_have_count(1)
        expect(page.locator("#usage-cost-chart svg rect.bar")).to_have_count(1)
        # The CSV export downloads the same rows.
        with page.expect_download() as dl:
            page.click("#usage-export")
        csv = open(dl.value.path(), encoding="utf-8").read()
        assert csv.startswith("day,team_id,team,model,requests"), csv[:200]
        assert "llama-3.1-8b-instruct" in csv, csv
        shot(page, "usage")

        # Queues: the model's queue with its last hour, and the refusals before any model.
        refused_request()
        page.click("#nav-queues")
        expect(page.locator("#queues-before-model")).to_contain_text("unauthorized")
        queue = page.locator('section.queue[data-model="llama-3.1-8b-instruct"]')
        expect(queue).to_be_visible()
        expect(queue.locator(".queue-depth")).to_be_visible()
        shot(page, "queues")

        # Reports: the cost and drift reports render without an error.
        page.click("#nav-reports")
        page.click("#reports-submit")
        expect(page.locator("#cost-models")).to_be_visible()
        expect(page.locator("#drift-models")).to_be_visible()
        expect(page.locator("#report-cost-msg")).not_to_have_class(re.compile(r"\berror\b"))
        shot(page, "reports")

        # Signing out forgets the token.
        page.click("#signout")
        expect(page.locator("#signin-token")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0
        browser.close()

    # Headless Chromium reports a CSP violation as a console error: none may happen.
    assert not problems, "\n".join(problems)
    print("console e2e: ok")


if __name__ == "__main__":
    main()

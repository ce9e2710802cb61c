"""A run made in the caller's own transformers code opens in the app: `model.generate` with `kvlens.cache`,
then `cache.save_run`, then the Head grid and Attention pages draw it in a real browser."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvlens
from kvlens import texts
from kvlens.ui.browser import wait_idle
from tests.browser.conftest import chromium_app, offline_page

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("offline")]


@pytest.fixture(scope="module")
def hf_runs_dir(tmp_path_factory):
    """One saved generation of SnapKV at ratio 0.5 that records attention, as `docs/transformers.md` makes
    it."""
    path = kvlens.model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(texts.read("1961-Kennedy")[:1500], return_tensors="pt").input_ids
    cache = kvlens.cache(model, "snapkv", ratio=0.5, record="attention")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False)
    root = tmp_path_factory.mktemp("runs")
    cache.save_run(root / "mine", out)
    return root


def test_the_saved_run_opens_on_the_head_grid_and_attention_pages(hf_runs_dir, external_requests):
    with chromium_app(hf_runs_dir) as (chromium, url):
        page = offline_page(chromium, external_requests)
        page.goto(f"{url}/heads?run=mine")
        wait_idle(page, "Head grid")
        main = page.locator("[data-testid='stMain']")
        assert (
            "at step 5 " in main.locator(".js-plotly-plot .gtitle").first.text_content()
        )  # 6 tokens: steps 0-5
        strips = page.evaluate(
            "() => document.querySelector('[data-testid=stMain] .js-plotly-plot')._fullData"
            ".find(d => d.name === 'heads').customdata.length"
        )
        assert strips == 30 * 9
        page.goto(f"{url}/attention?run=mine&layer=12&head=2")
        wait_idle(page, "Attention")
        assert "Attention of layer 12, head 2" in main.locator(".js-plotly-plot .gtitle").first.text_content()
        assert not main.locator("[data-testid='stAlert']").filter(has_text="error").count()

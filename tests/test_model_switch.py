"""Switching the served model without a restart: from the configured list, with the fit shown before loading, the
load's progress in the page, and the previous engine's memory released.

This app loads its own engines (the shared session engines must stay loaded for the other tests)."""

from __future__ import annotations

import gc
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import launch
from llm_core.engine.compare import CompareConfig, EnginePool
from llm_core.errors import InputError, ModelLoadError
from tests.conftest import make_settings
from tests.test_app import CHROMIUM, CHROMIUM_FLAGS, free_port
from ui import build_demo


@pytest.fixture(scope="module")
def switching_app() -> Iterator[dict[str, Any]]:
    settings = make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH="plain",
                             COMPARE_MODES="none,nf4-nodq,nf4")
    pool = EnginePool(settings)
    engine = pool.primary()  # loaded here, owned by this test module
    demo = build_demo(engine, settings, pool)
    port = free_port()
    launch(demo, settings.replace(server={"port": port}), pool, prevent_thread_lock=True, quiet=True)
    state = {"url": f"http://127.0.0.1:{port}/", "pool": pool, "settings": settings,
             "model": weakref.ref(engine.loaded.model)}
    del engine
    try:
        yield state
    finally:
        demo.close()
        for config in pool.resident():
            pool.unload(config)


def test_only_configured_models_and_modes_can_be_served(switching_app: dict[str, Any]) -> None:
    pool: EnginePool = switching_app["pool"]
    with pytest.raises(InputError, match="COMPARE_MODELS"):
        pool.switch_primary(CompareConfig("/somewhere/else", "none"))
    with pytest.raises(InputError, match="not enabled"):
        pool.switch_primary(CompareConfig(None, "int8"))
    assert pool.primary_config == CompareConfig(None, "none")  # nothing changed


def test_a_model_that_cannot_fit_is_refused_before_the_served_one_is_unloaded(
        switching_app: dict[str, Any]) -> None:
    pool: EnginePool = switching_app["pool"]
    served, resident, room = pool.primary_config, pool.resident(), pool.reserve_bytes
    pool.reserve_bytes = 2**50  # working room no machine has
    try:
        assert not pool.fit(CompareConfig(None, "nf4")).fits
        with pytest.raises(ModelLoadError, match="does not fit"):
            pool.switch_primary(CompareConfig(None, "nf4"))
    finally:
        pool.reserve_bytes = room
    assert pool.primary_config == served and pool.resident() == resident  # still loaded, still serving


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                    reason="Debian chromium not installed (make test installs it)")
def test_switch_model_in_the_browser_shows_fit_and_progress_and_frees_the_old_engine(
        switching_app: dict[str, Any], artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    pool: EnginePool = switching_app["pool"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(switching_app["url"])
            expect(page.locator("#header")).to_contain_text("· none ·")
            page.locator("#model-panel").get_by_text("Model", exact=True).first.click()
            page.locator("#switch-mode input").click()
            page.get_by_role("option", name="nf4-nodq").click()
            fit = page.locator("#switch-fit")  # the prediction, before anything loads
            expect(fit).to_contain_text("embedded · nf4-nodq · sdpa needs about", timeout=30_000)
            expect(fit).to_contain_text("available now")
            assert pool.resident() == [CompareConfig(None, "none")]
            page.locator("#switch-load").click()
            status = page.locator("#switch-status")
            expect(status).to_contain_text("Loading weights of", timeout=120_000)  # progress while it loads
            expect(status).to_contain_text("Now serving embedded · nf4-nodq · sdpa", timeout=180_000)
            for step in ("Loading embedded · nf4-nodq · sdpa", "Warming up", "Unloaded embedded · none · sdpa"):
                expect(status).to_contain_text(step)
            expect(page.locator("#header")).to_contain_text("· nf4 ·")
            expect(page.locator("#model-info")).to_contain_text("nf4")
            page.screenshot(path=str(artifacts_dir / "model-switch.png"), full_page=True)

            page.locator("#chat-input textarea").fill("What is the capital of France?")
            page.locator("#send").click()  # the next reply comes from the new model
            expect(page.locator("#stats")).to_contain_text("Finished by", timeout=120_000)
            page.get_by_role("tab", name="Session stats").click()
            expect(page.locator("#history-table")).to_contain_text("embedded · nf4-nodq · sdpa", timeout=20_000)
        finally:
            browser.close()
    assert pool.resident() == [CompareConfig(None, "nf4-nodq")]
    gc.collect()
    assert switching_app["model"]() is None  # the previous model object is gone, not just unlisted

"""``GET /sgl_spec/cache``: the turn-aware tree summary, served beside sglang's API.

The tree lives in the scheduler process and the HTTP server in the launcher's,
so the summary travels on sglang's own internal-state request: the scheduler
side adds it under :data:`KEY`, and the route collects it from every DP rank.
"""

from __future__ import annotations

KEY = "sgl_spec_cache"
ROUTE = "/sgl_spec/cache"


def patch_internal_state(module) -> None:
    """Wrap ``SchedulerInternalStateController.get_internal_state`` (scheduler) to add the
    summary when the scheduler's tree cache is a SpecRadixCache. Idempotent."""
    cls = module.SchedulerInternalStateController
    orig = cls.get_internal_state
    if getattr(orig, "_sgl_spec", False):
        return

    def get_internal_state(self, recv_req):
        out = orig(self, recv_req)
        summary = getattr(self.scheduler.tree_cache, "summary", None)
        if summary is not None:
            out.internal_state[KEY] = summary()
        return out

    get_internal_state._sgl_spec = True
    cls.get_internal_state = get_internal_state


def add_route() -> None:
    """Register the route on sglang's FastAPI app (launcher process). Idempotent."""
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return

    @app.get(ROUTE)
    async def sgl_spec_cache():
        """Per conversation branch: rounds with roles, token counts, tier and last
        access; totals by role and tier; tokens freed per eviction rule."""
        manager = http_server.get_global_state().tokenizer_manager
        states = await manager.get_internal_state()
        ranks = [s.get(KEY) for s in states]
        if all(r is None for r in ranks):
            return ORJSONResponse(
                {"error": "the server does not run sgl_spec's radix cache "
                          "(--radix-cache-backend sgl_spec)"},
                status_code=404,
            )
        return ranks[0] if len(ranks) == 1 else {"dp_ranks": ranks}

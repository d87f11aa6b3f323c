"""A tiny OpenEnv environment for Kiln's tests, served by openenv-core's ``create_app``.

``python -m tests.openenv.guess_env PORT:MODE [PORT:MODE ...]`` serves one app per mode on
127.0.0.1, all in one process (openenv-core imports gradio: seconds per process), each app on
its own thread and event loop so a slow step blocks only its own server. The game: guess
a digit; the reward is 1 for TARGET and falls off with the distance. Modes change one
thing each, so every termination kind and refusal has a server to meet:

* ``guess``: one step, then done.
* ``counter``: never done (Kiln's max_steps ends the episode).
* ``error``: step raises (OpenEnv answers an EXECUTION_ERROR frame).
* ``slow``: step sleeps 3 s (an exchange timeout).
* ``huge``: step's observation carries 2 MiB of text (over a 1 MiB frame cap; protocol-legal).
* ``drift``: also serves /list_environments, whose answer changes on every call.
"""

from __future__ import annotations

import sys
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TARGET = 0


class GuessAction(Action):
    guess: int = Field(ge=0, le=9, description="a digit")


class GuessObservation(Observation):
    prompt: str = ""
    last_guess: int | None = None
    text: str = ""


class GuessEnv(Environment):
    mode = "guess"  # set per served app by build_app

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Guess the digit (round {seed}).", done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if self.mode == "error":
            raise RuntimeError("the environment failed on purpose")
        if self.mode == "slow":
            time.sleep(3)
        reward = 1.0 - abs(action.guess - TARGET) / 9.0
        text = "x" * (2 * 1024 * 1024) if self.mode == "huge" else ""
        return GuessObservation(prompt="again", last_guess=action.guess, text=text,
                                done=self.mode != "counter", reward=reward)

    @property
    def state(self) -> State:
        return self._state


def build_app(mode: str):
    env_class = type(f"GuessEnv_{mode}", (GuessEnv,), {"mode": mode})
    app = create_app(env_class, GuessAction, GuessObservation, env_name="guess")
    if mode == "drift":
        calls = [0]

        @app.get("/list_environments")
        def list_environments() -> dict:
            calls[0] += 1
            return {"environments": ["guess"], "generation": calls[0]}
    return app


def serve(pairs: list[str]) -> None:
    """Serve ``PORT:MODE`` apps until the process is terminated, each on its own thread."""
    import threading

    import uvicorn

    threads = []
    for pair in pairs:
        port, mode = pair.split(":")
        server = uvicorn.Server(uvicorn.Config(build_app(mode), host="127.0.0.1", port=int(port),
                                               log_level="warning"))
        threads.append(threading.Thread(target=server.run, name=f"guess-{mode}", daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    serve(sys.argv[1:])

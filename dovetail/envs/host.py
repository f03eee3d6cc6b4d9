"""Episodes run out of the caller's process, as a user's reward is (`dovetail.rewards.process`): a user's environment
may hang, hold the GIL in C or end its process, and `timeout_s` still holds. One `EnvironmentHost` keeps one process
(a `rewards.process.Server`) and the episodes of one environment in it, by trajectory; each call (making the
environment and resetting it, a step) is stopped after `timeout_s` whatever it does.

A call that overruns or ends the process takes every episode in it down with the process: that call is an
EnvironmentFailed naming the environment, the trajectory and what happened, and so is any later call on another
episode that was in the process (its state is gone); a new episode starts a new process. What an environment raises
is an EnvironmentFailed too, its process and episodes kept. Calls are one at a time: a second caller waits."""

import signal
from multiprocessing.connection import Connection

from dovetail.envs import check_options, make_environment
from dovetail.envs.contract import Latency
from dovetail.envs.episode import EnvironmentFailed, Episode, Stepped
from dovetail.graph.node import SampleId
from dovetail.rewards.process import Failed, Server, describe

SERVE = "import sys; from dovetail.envs.host import serve; serve(int(sys.argv[1]))"
"""The episodes' process's program; its argument is the descriptor of its end of the pipe."""


class EnvironmentHost:
    """The episodes of environment `name` in a process of their own, each call limited to `timeout_s` seconds:
    `options`, `parser` and `latency` are the run's `env.options`, `env.parser` and `env.latency` (`Episode`), `seed`
    the run's."""

    def __init__(self, name: str, options: dict, parser: str, latency: Latency, seed: int, timeout_s: float):
        check_options(name, options)
        self.name, self.options, self.parser, self.latency = name, options, parser, latency
        self.seed, self.timeout_s = seed, timeout_s
        self.server = Server(SERVE)
        self.open: set[SampleId] = set()
        """The trajectories whose episodes live in the process now."""
        self.lost: dict[SampleId, str] = {}
        """Trajectories whose episodes a stopped process took with it, and why."""

    def reset(self, sample: SampleId, row: dict) -> str:
        """A new episode for trajectory `sample` from its dataset row: its first observation."""
        sample = SampleId(*sample)
        self.lost.pop(sample, None)
        observation = self._ask(
            sample, ("reset", sample, (self.name, self.options, self.parser, self.latency, self.seed, row))
        )
        self.open.add(sample)
        return observation

    def tools(self) -> tuple[dict, ...]:
        """The schemas (`Tool.schema()`) of the tools an environment offers, one made for the question and let go in
        the episodes' process: what a rollout offers the model in its prompt, and where its turns that call end."""
        return self._ask(None, ("tools", None, (self.name, self.options)))

    def step(self, sample: SampleId, text: str) -> Stepped:
        """Trajectory `sample`'s episode answers a model turn."""
        return self._ask(SampleId(*sample), ("step", sample, text))

    def close(self, sample: SampleId) -> None:
        """Trajectory `sample`'s episode is over: its environment is let go."""
        sample = SampleId(*sample)
        self.lost.pop(sample, None)
        if sample in self.open:
            self.open.discard(sample)
            self._ask(sample, ("close", sample, None))

    def stop(self) -> None:
        """End the process, and with it every episode."""
        self.server.stop()
        self.open.clear()

    def _ask(self, sample: SampleId | None, request: tuple):
        """The process's answer to `request`, made for trajectory `sample` (None: for no trajectory, `tools`)."""
        if sample in self.lost:
            raise EnvironmentFailed(self.lost[sample])
        with self.server.lock:
            try:
                outcome, detail = self.server.ask(request, self.timeout_s)
            except Failed as error:
                raise EnvironmentFailed(f"environment {self.name!r} {error}") from None
        if outcome == "returned":
            return detail
        if outcome == "raised":
            raise EnvironmentFailed(str(detail))
        where = "listing its tools" if sample is None else f"on trajectory {tuple(sample)}"
        if outcome == "overran":
            happened = f"took longer than timeout_s={self.timeout_s:g} s {where} and was stopped"
        elif outcome == "ended":
            happened = f"ended its process (exit code {detail}) {where}"
        else:
            happened = f"failed {where}: {detail}"
        message = f"environment {self.name!r} {happened}"
        for other in self.open - {sample}:
            self.lost[other] = f"{message}, and trajectory {tuple(other)}'s episode, in the same process, went with it"
        self.open.clear()
        raise EnvironmentFailed(message)


def serve(descriptor: int) -> None:
    """The episodes' process: answer each (what, trajectory, detail) request with ("returned", ...) or ("raised",
    one line), until the caller's end closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle, as in the reward process
    connection = Connection(descriptor)
    episodes: dict[SampleId, Episode] = {}
    connection.send(("ready", None))
    while True:
        try:
            what, sample, detail = connection.recv()
        except EOFError:
            return
        answer: str | Stepped | tuple[dict, ...] | None
        try:
            if what == "tools":
                name, options = detail
                answer = tuple(tool.schema() for tool in make_environment(name, options).tools)
            elif what == "reset":
                name, options, parser, latency, seed, row = detail
                episodes[sample] = Episode(make_environment(name, options), name, parser, latency, seed, sample)
                answer = episodes[sample].reset(row)
            elif what == "step":
                if sample not in episodes:
                    raise EnvironmentFailed(f"trajectory {tuple(sample)} has no episode: reset it first")
                answer = episodes[sample].step(detail)
            else:  # close
                episodes.pop(sample, None)
                answer = None
        except (EnvironmentFailed, ValueError) as error:
            connection.send(("raised", str(error)))
            continue
        except BaseException as error:  # SystemExit too: the environment's failure, not the process's end
            where = "listing its tools" if sample is None else f"on trajectory {tuple(sample)}"
            connection.send(("raised", f"environment failed {where}: {describe(error)}"))
            continue
        try:
            connection.send(("returned", answer))
        except Exception as error:  # pickling it failed
            connection.send(("failed", f"gave an answer that cannot leave its process ({describe(error)})"))

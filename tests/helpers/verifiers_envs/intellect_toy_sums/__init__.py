"""A single-turn verifiers taskset: "What is a + b?", rewarded for the exact sum (weight 1) and for a reply that
evaluates to it (weight 0.5: ``eval`` of the reply, as calculator-style rubrics do, so a test can see a
completion's code run, in the jail)."""

import verifiers.v1 as vf

SYSTEM = "Answer with the number only."


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def evaluates(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if str(eval(trace.last_reply)) == task.answer else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 50
    top: int = 20


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = (7 * i + 3) % self.config.top, (11 * i + 5) % self.config.top
            yield SumTask(
                SumData(id=f"sum-{i}", prompt=f"What is {a} + {b}?", system_prompt=SYSTEM, answer=str(a + b)),
                self.config.task,
            )


__all__ = ["SumTaskset"]

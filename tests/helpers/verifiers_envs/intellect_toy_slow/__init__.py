"""A single-turn verifiers taskset over the tiny model's alphabet ("12+7=") whose reward takes a minute: a
trainer judging its batches is busy for long enough that a test can stop it in the middle."""

import asyncio

import verifiers.v1 as vf


class SlowData(vf.TaskData):
    answer: str


class SlowTask(vf.Task[SlowData]):
    @vf.reward(weight=1.0)
    async def exact(self, task: SlowData, trace: vf.Trace) -> float:
        await asyncio.sleep(60)
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0


class SlowTaskset(vf.Taskset[SlowTask, vf.TasksetConfig]):
    def load(self):
        for i in range(20):
            a, b = i % 10, (3 * i) % 10
            yield SlowTask(SlowData(id=f"slow-{i}", prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SlowTaskset"]

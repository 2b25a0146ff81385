"""A verifiers taskset whose reward runs in a sandbox runtime (a tool environment): not a task set for the
``verifiers`` family, which scores single-turn replies from the reply alone."""

import verifiers.v1 as vf


class ToolTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def tests_pass(self, task: vf.TaskData, trace: vf.Trace, runtime: object) -> float:
        return 1.0


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield ToolTask(vf.TaskData(id=f"tool-{i}", prompt=f"Fix bug {i}."), self.config.task)


__all__ = ["ToolTaskset"]

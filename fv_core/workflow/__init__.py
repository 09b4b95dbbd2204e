"""Cross-model workflows: stages on served models, declared in a deploy file (``workflows:``)."""

from fv_core.workflow.check import check_workflow
from fv_core.workflow.registered import deploy_workflows, registered_workflow
from fv_core.workflow.run import LoadedWorkflow, Score, bind_workflows
from fv_core.workflow.spec import SelectSpec, StageSpec, WorkflowSpec

__all__ = [
    "LoadedWorkflow",
    "Score",
    "SelectSpec",
    "StageSpec",
    "WorkflowSpec",
    "bind_workflows",
    "check_workflow",
    "deploy_workflows",
    "registered_workflow",
]

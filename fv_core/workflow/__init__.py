"""Cross-model workflows: stages on served models, declared in a deploy file (``workflows:``)."""

from fv_core.workflow.check import check_workflow
from fv_core.workflow.run import LoadedWorkflow
from fv_core.workflow.spec import StageSpec, WorkflowSpec

__all__ = ["LoadedWorkflow", "StageSpec", "WorkflowSpec", "check_workflow"]

"""Plan a (batch, domain, model) job before it runs, and check a model against one process.

Usage::

    from mesh3d.planner import CheckSpec, InputSpec, JobMesh, check_model, plan_job
    job = plan_job(make_model, Plan(), JobMesh.resolve(4096, domain=(4, 4), model=4), InputSpec((1, 1, 512, 512)))
    print(job.table())                                                   # or job.to_json()
    print(check_model(CheckSpec(make_model, Plan(), InputSpec((1, 1, 32, 32)))).table())

See docs/plan.md.
"""

from mesh3d.planner.check import CheckSpec
from mesh3d.planner.check_run import CheckReport, check_model
from mesh3d.planner.job import plan_job
from mesh3d.mesh_shape import JobMesh
from mesh3d.planner.report import JobPlan, RankClass
from mesh3d.planner.simulate import InputSpec, default_loss

__all__ = ["CheckReport", "CheckSpec", "InputSpec", "JobMesh", "JobPlan", "RankClass", "check_model", "default_loss",
           "plan_job"]

"""Plan a (batch, domain, model) job before it runs.

Usage::

    from mesh3d.planner import InputSpec, JobMesh, plan_job
    job = plan_job(make_model, Plan(), JobMesh.resolve(4096, domain=(4, 4), model=4), InputSpec((1, 1, 512, 512)))
    print(job.table())                                                   # or job.to_json()

See docs/plan.md.
"""

from mesh3d.planner.job import plan_job
from mesh3d.planner.mesh import JobMesh
from mesh3d.planner.report import JobPlan, RankClass
from mesh3d.planner.simulate import InputSpec, default_loss

__all__ = ["InputSpec", "JobMesh", "JobPlan", "RankClass", "default_loss", "plan_job"]

"""Options of `inferx-scheduler` (flags or INFERX_* environment variables)."""

from pydantic import Field

from inferx.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    max_queued_per_pool: int = Field(1024, gt=0, description="bound of each pool's hop queue")
    reserve_kv: bool = Field(True, description="reserve KV capacity in the memory-pool per hop")

"""Teams: a supervisor hands a task to a member agent with its ``handoff`` tool and reads back
only the member's artifact, checked against the schema the supervisor's manifest declares."""

from actors.handoff.plan import Member
from actors.handoff.tool import Handoffs, handoff_tool

__all__ = ["Handoffs", "Member", "handoff_tool"]

"""Parts every family may hold: step accounting, lr scaling, the initial broadcast, fixed accumulation, and
the :class:`~quietsync.strategies.parts.part.Part` base class that declares what a held part can offer."""

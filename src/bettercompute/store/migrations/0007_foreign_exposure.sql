-- Foreign GPU exposure: what besides bcd can hand a node's GPUs to pods, as its agent last
-- reported it (the GPUNode's ForeignGpuExposure condition); NULL while only bcd does. An active
-- reservation on such a node is Degraded with reason ForeignGpuExposure; nothing is released.
ALTER TABLE nodes ADD COLUMN foreign_exposure text;

-- mm schema version 5: the global-sequence allocator's chunks, as Raft
-- agreed them (cluster.rs materializes the state machine; read-only for
-- operators). `range_start..range_end` went to `node`; chunks are never
-- handed out twice, also after the node is removed.
CREATE TABLE mm.sequence_ranges (
  sequence_name text NOT NULL,
  node text NOT NULL,
  range_start bigint NOT NULL,
  range_end bigint NOT NULL,
  PRIMARY KEY (sequence_name, range_start));

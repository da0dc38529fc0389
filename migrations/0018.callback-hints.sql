-- Completion callbacks that come while the job's poll is claimed or its GET is in flight (docs/callbacks.md, "A
-- callback during a poll"): note_callback stamps hinted_at; the observer's claim clears it (the GET that follows
-- comes after every callback recorded so far); a save that still finds it (the callback came during that GET,
-- which may have read the job just before it ended) makes the next poll due now instead of after its delay, and
-- clears it. So each callback costs at most one extra GET, and its news is never lost to the fallback poll.
-- depends: 0016.wakeup-kinds

ALTER TABLE operations ADD COLUMN hinted_at timestamptz;

-- The backlogs `scripts/rig instructions` drains under callgrind: 20,000 messages of 100-message
-- batches in each of three streams, as W10's: no keys; 1,024 keys in a group without an override
-- (parallel); the same keys in an ordered group. Each stream's `carried` row holds what the next
-- claim acks (the previous claim's token and ids), so one statement per claim carries them.
CREATE EXTENSION sqlstreams;
CREATE TABLE carried (stream text PRIMARY KEY, token uuid, ids bigint[]);

CREATE FUNCTION fill(stream text, override text, keyed boolean) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM sqlstreams.create_stream(stream);
    PERFORM sqlstreams.create_group(stream, 'g', override);
    FOR b IN 0..19900 BY 100 LOOP
        PERFORM count(*) FROM sqlstreams.produce_batch(stream,
            ARRAY(SELECT format('{"i": %s, "pad": "%s"}', b + i, repeat('x', 110))::jsonb
                  FROM generate_series(0, 99) i),
            CASE WHEN keyed THEN ARRAY(SELECT 'k' || ((b + i) % 1024) FROM generate_series(0, 99) i) END);
    END LOOP;
    INSERT INTO carried VALUES (stream, NULL, NULL);
END $$;

SELECT fill('none', NULL, false);
SELECT fill('keyed', NULL, true);
SELECT fill('ordered', 'ordered', true);
CHECKPOINT;

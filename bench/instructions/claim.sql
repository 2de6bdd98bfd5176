-- One claim of 100 on stream :'stream', carrying the previous claim's acks (bench/instructions/fill.sql).
WITH c AS (SELECT * FROM sqlstreams.claim(:'stream', 'g', 100, '60 seconds',
                                          (SELECT token FROM carried WHERE stream = :'stream'),
                                          (SELECT ids FROM carried WHERE stream = :'stream'))),
     next AS (UPDATE carried SET token = (SELECT lease_token FROM c LIMIT 1),
                                 ids = (SELECT array_agg(message_id) FROM c)
              WHERE stream = :'stream')
SELECT count(*) FROM c;

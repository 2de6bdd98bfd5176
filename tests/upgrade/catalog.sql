-- The catalog of the installed sqlstreams extension as sorted text lines: what scripts/rig
-- compares between a fresh install, an upgraded install and the library's own declarations.
-- Per-stream objects are included for stream id 1 only (each database compared has one).
WITH objects AS (
    -- Functions: signature, result, volatility/parallel/strict/definer, language, entry point
    -- (C) or body (others), and settings.
    SELECT format('function %s %s -> %s %s%s%s%s %s', l.lanname, p.oid::regprocedure,
                  pg_catalog.pg_get_function_result(p.oid), p.provolatile, p.proparallel,
                  CASE WHEN p.proisstrict THEN ' strict' ELSE '' END,
                  CASE WHEN p.prosecdef THEN ' definer' ELSE '' END,
                  CASE WHEN l.lanname = 'c' THEN p.prosrc ELSE pg_catalog.md5(p.prosrc) END) AS line
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
    WHERE p.pronamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('function-arguments %s %s %s', l.lanname, p.oid::regprocedure, pg_catalog.pg_get_function_arguments(p.oid))
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
    WHERE p.pronamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('function-config %s %s', p.oid::regprocedure, p.proconfig)
    FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'sqlstreams'::regnamespace
    UNION ALL
    -- Relations and their columns, in column order.
    SELECT format('relation %s %s replica identity %s', c.relname, c.relkind, c.relreplident)
    FROM pg_catalog.pg_class c WHERE c.relnamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('column %s %s %s %s%s%s', c.relname, a.attnum, a.attname,
                  pg_catalog.format_type(a.atttypid, a.atttypmod),
                  CASE WHEN a.attnotnull THEN ' not null' ELSE '' END,
                  coalesce(' default ' || pg_catalog.pg_get_expr(d.adbin, d.adrelid), '')
                  || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
                  || CASE WHEN a.attcompression <> '' THEN ' compression ' || a.attcompression::text ELSE '' END)
    FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
    WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relkind IN ('r', 'p', 'v')
    UNION ALL
    SELECT format('index %s', pg_catalog.pg_get_indexdef(i.indexrelid))
    FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
    WHERE c.relnamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('constraint %s %s %s', co.conrelid::regclass, co.conname, pg_catalog.pg_get_constraintdef(co.oid))
    FROM pg_catalog.pg_constraint co WHERE co.connamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('partition %s %s', c.relname, pg_catalog.pg_get_expr(c.relpartbound, c.oid))
    FROM pg_catalog.pg_class c WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relispartition
    UNION ALL
    SELECT format('sequence %s %s %s %s', c.relname, s.seqtypid::regtype, s.seqmin, s.seqcache)
    FROM pg_catalog.pg_sequence s JOIN pg_catalog.pg_class c ON c.oid = s.seqrelid
    WHERE c.relnamespace = 'sqlstreams'::regnamespace
    UNION ALL
    SELECT format('trigger %s', pg_catalog.pg_get_triggerdef(t.oid))
    FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
    WHERE c.relnamespace = 'sqlstreams'::regnamespace AND NOT t.tgisinternal
    UNION ALL
    SELECT format('event-trigger %s %s %s %s %s', e.evtname, e.evtevent, e.evttags, e.evtfoid::regprocedure, e.evtenabled)
    FROM pg_catalog.pg_event_trigger e
    WHERE e.evtfoid IN (SELECT oid FROM pg_catalog.pg_proc WHERE pronamespace = 'sqlstreams'::regnamespace)
    UNION ALL
    SELECT format('view %s %s', c.relname, pg_catalog.pg_get_viewdef(c.oid))
    FROM pg_catalog.pg_class c WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relkind = 'v'
    UNION ALL
    -- Documentation.
    SELECT format('comment %s %s', pg_catalog.pg_describe_object(dsc.classoid, dsc.objoid, dsc.objsubid), dsc.description)
    FROM pg_catalog.pg_description dsc
    WHERE (dsc.classoid = 'pg_catalog.pg_proc'::regclass
           AND dsc.objoid IN (SELECT oid FROM pg_catalog.pg_proc WHERE pronamespace = 'sqlstreams'::regnamespace))
       OR (dsc.classoid = 'pg_catalog.pg_class'::regclass
           AND dsc.objoid IN (SELECT oid FROM pg_catalog.pg_class WHERE relnamespace = 'sqlstreams'::regnamespace))
       OR (dsc.classoid = 'pg_catalog.pg_namespace'::regclass AND dsc.objoid = 'sqlstreams'::regnamespace)
    UNION ALL
    -- What belongs to the extension, and what pg_dump keeps of its tables.
    SELECT format('member %s', pg_catalog.pg_describe_object(dep.classid, dep.objid, dep.objsubid))
    FROM pg_catalog.pg_depend dep
    WHERE dep.refclassid = 'pg_catalog.pg_extension'::regclass AND dep.deptype = 'e'
      AND dep.refobjid = (SELECT oid FROM pg_catalog.pg_extension WHERE extname = 'sqlstreams')
    UNION ALL
    SELECT format('config-dump %s', cfg) FROM pg_catalog.pg_extension e, unnest(e.extconfig::regclass[]) cfg
    WHERE e.extname = 'sqlstreams'
    UNION ALL
    -- Privileges.
    SELECT format('acl %s %s', c.relname, c.relacl) FROM pg_catalog.pg_class c
    WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relacl IS NOT NULL
    UNION ALL
    SELECT format('acl %s %s', p.oid::regprocedure, p.proacl) FROM pg_catalog.pg_proc p
    WHERE p.pronamespace = 'sqlstreams'::regnamespace AND p.proacl IS NOT NULL
)
SELECT line FROM objects
-- Only stream 1's tables: names carry the stream id as `_<id>` (partitions add `_p<n>`).
WHERE line !~ '_([2-9]|[1-9][0-9]+)(_|\s|\.|\(|$)'
ORDER BY line;

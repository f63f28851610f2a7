-- Whether any key was ever minted (a token-less loopback node is open only until then), and
-- whether a live admin key with no agent list exists (what lets a public bind run without a token).
SELECT EXISTS (SELECT 1 FROM api_keys),
       EXISTS (SELECT 1 FROM api_keys
                WHERE revoked_at IS NULL AND scope = 'admin' AND agents IS NULL)

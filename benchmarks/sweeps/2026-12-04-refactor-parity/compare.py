import json, sys
a=[json.loads(l) for l in open(sys.argv[1])]
b=[json.loads(l) for l in open(sys.argv[2])]
keys=[(i,k) for i,r in enumerate(a) for k in r if k!='time' and not k.startswith('perf/')]
diff=[(i,k,a[i][k],b[i].get(k) if i<len(b) else None) for i,k in keys if i>=len(b) or a[i][k]!=b[i].get(k)]
extra=[(i,k) for i,r in enumerate(b) for k in r if k not in a[i]] if len(a)==len(b) else "rows differ"
print(f"rows {len(a)} vs {len(b)}; values compared {len(keys)}; differing {len(diff)}; extra keys {extra}")
for d in diff[:10]: print("  ", d)

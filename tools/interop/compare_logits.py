# Compares a moe-run --dump-logits NPY file with the raw f32 logits of llama_dump_logits (same rows).
import sys, struct, ast
npy, raw = sys.argv[1], sys.argv[2]
b=open(npy,'rb').read()
hl=struct.unpack('<H',b[8:10])[0]; hdr=ast.literal_eval(b[10:10+hl].decode()); rows,V=hdr['shape']
a=struct.unpack(f'<{rows*V}f', b[10+hl:10+hl+rows*V*4])
c=open(raw,'rb').read(); n=len(c)//4; l=struct.unpack(f'<{n}f', c)
r2=n//V; rows=min(rows,r2)
md=[max(abs(a[i*V+k]-l[i*V+k]) for k in range(V)) for i in range(rows)]
am=sum(1 for i in range(rows) if max(range(V),key=lambda k:a[i*V+k])==max(range(V),key=lambda k:l[i*V+k]))
print(f'rows {rows} V {V}: max|diff| per row median {sorted(md)[len(md)//2]:.4f} max {max(md):.4f}; argmax agree {am}/{rows}')

"""The review page's style sheet and script (ingest.review.page writes them inline: the page needs no network). The
script filters by grade (also from the address, ``#grade=poor``), picks pages and copies their ``uflash rerun``
commands, lights up a box and its text together, and moves with the keyboard (j/k, x, c, a/g/f/p/r). ``LIVE_SCRIPT`` is
added when the review server (``uflash review``) serves the page: editing, saving, undoing, checking, re-runs."""

REVIEW_PX = 1000  # long side of the page image shown for fair and poor pages
THUMB_PX = 260  # ... for good pages

STYLE = """
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d1d1d;background:#fafafa}
header.top{position:sticky;top:0;z-index:5;background:#fff;border-bottom:1px solid #bbb;padding:.6em 1.2em}
header.top h1{font-size:1.15em;margin:0 0 .3em}
.bar{display:flex;flex-wrap:wrap;gap:.4em;align-items:center}
.warn{background:#fff3cd;border:1px solid #b80;padding:.3em .6em;margin:.3em 0}
.bar button,.page button{font:inherit;padding:.2em .6em;border:1px solid #888;border-radius:4px;background:#f4f4f4;
 cursor:pointer}
.bar button[aria-pressed=true]{background:#224;color:#fff}
button:focus-visible,input:focus-visible,[data-el]:focus-visible,section.page:focus-visible{outline:3px solid #e07000;
 outline-offset:2px}
#command{margin:.4em 0 0;white-space:pre-wrap;font:12px/1.3 monospace;background:#f3f3f3;padding:.3em;max-height:6em;
 overflow:auto}
#command:empty{display:none}
.keys{color:#555;font-size:12px}
main{padding:0 1.2em}
h2{margin:1.2em 0 .2em;font-size:1.1em}
section.files ul{list-style:none;margin:.3em 0;padding:0}
section.files li{margin:.15em 0;overflow-wrap:anywhere}
.f-refused strong,.f-failed strong{color:#a00}.f-waiting strong{color:#850}.f-duplicate strong{color:#555}
section.page{border-top:1px solid #ccc;padding:.8em 0}
section.page[hidden]{display:none}
.head{display:flex;gap:.6em;align-items:baseline;flex-wrap:wrap}
.head h3{margin:0;font-size:1em}
.grade{font-weight:bold;padding:0 .45em;border-radius:3px}
.g-good{background:#c9efc9}.g-fair{background:#fbf1b0}.g-poor{background:#f7c4c4}.g-ungraded{background:#ddd}
ul.why{margin:.2em 0 .4em 1.2em;padding:0}
.repair{margin:.2em 0;color:#234}
.cols{display:grid;grid-template-columns:minmax(0,auto) minmax(18em,1fr);gap:1.2em;align-items:start}
.scan{position:relative;display:inline-block;border:1px solid #999;background:#fff;line-height:0}
.scan img{display:block;max-width:100%}
.scan svg{position:absolute;left:0;top:0;width:100%;height:100%}
.scan rect{fill:rgba(40,110,230,.07);stroke:rgba(30,90,210,.85);stroke-width:1.5;vector-effect:non-scaling-stroke}
.scan rect.hl,.scan rect:hover{fill:rgba(250,160,0,.25);stroke:#d06000;stroke-width:2.5}
.text{font:13px/1.5 Georgia,serif;max-height:70vh;overflow:auto;background:#fff;border:1px solid #ddd;padding:.5em}
.el{padding:.15em .3em;margin:0 0 .35em;border-left:3px solid transparent}
.el.hl{background:#fff1d6;border-left-color:#d06000}
.el .label{font:11px system-ui,sans-serif;color:#777;margin-right:.4em}
mark.unsure{background:#ffd2a8;text-decoration:underline dotted #b04000}
details.figures table td{padding:0 .6em 0 0;font-size:12px}
code.cmd{font:12px monospace;background:#f0f0f0;padding:.1em .3em}
.state{font-size:12px;padding:0 .4em;border-radius:3px}.state.corrected{background:#d8e6ff}.state.checked{background:#c9efc9}
.review{display:flex;gap:.4em;align-items:center;flex-wrap:wrap;margin:.2em 0}
.words[contenteditable=true]{outline:1px dashed #06c;background:#f6fbff;display:block;min-height:1em}
#reruns{margin:.2em 0;padding-left:1.2em;font-size:12px}#reruns:empty{display:none}
.good-small .scan img{max-width:THUMBpx}
""".replace("THUMB", str(THUMB_PX))

SCRIPT = r"""
(function(){
var sections=[].slice.call(document.querySelectorAll('section.page'));
var status=document.getElementById('status');
function want(){var m=/grade=(\w+)/.exec(location.hash||'');return m?m[1]:'all';}
function applyFilter(){
  var w=want(),shown=0;
  sections.forEach(function(s){
    var on=w==='all'||s.dataset.grade===w||(w==='repaired'&&s.dataset.repaired==='1');
    s.hidden=!on; if(on){shown++;}
  });
  document.body.dataset.filter=w; document.getElementById('shown').textContent=shown;
  document.querySelectorAll('.bar button[data-grade]').forEach(function(b){
    b.setAttribute('aria-pressed',b.dataset.grade===w?'true':'false');});
}
function setFilter(g){history.replaceState(null,'',g==='all'?location.pathname+location.search:'#grade='+g);applyFilter();}
document.querySelectorAll('.bar button[data-grade]').forEach(function(b){
  b.addEventListener('click',function(){setFilter(b.dataset.grade);});});
window.addEventListener('hashchange',applyFilter);
// element boxes <-> text
function light(ev,on){
  var t=ev.target.closest&&ev.target.closest('[data-el]'); if(!t){return;}
  var sec=t.closest('section.page');
  sec.querySelectorAll('[data-el="'+t.dataset.el+'"]').forEach(function(e){e.classList.toggle('hl',on);});
}
['mouseover','focusin'].forEach(function(n){document.addEventListener(n,function(e){light(e,true);});});
['mouseout','focusout'].forEach(function(n){document.addEventListener(n,function(e){light(e,false);});});
// picking pages and the re-run commands
function ranges(nums){
  nums.sort(function(a,b){return a-b;}); var out=[],a=null,b=null;
  nums.forEach(function(n){if(a===null){a=b=n;}else if(n===b+1){b=n;}else{out.push([a,b]);a=b=n;}});
  if(a!==null){out.push([a,b]);} return out;
}
function commands(secs){
  var byDoc={},order=[];
  secs.forEach(function(s){var d=s.dataset.doc; if(!byDoc[d]){byDoc[d]=[];order.push(d);} byDoc[d].push(+s.dataset.page);});
  var lines=[];
  order.forEach(function(d){ranges(byDoc[d]).forEach(function(r){
    lines.push(document.body.dataset.rerun+' --doc '+d+' --pages '+r[0]+'-'+r[1]);});});
  return lines.join('\n');
}
function picked(){return sections.filter(function(s){return s.querySelector('input.pick').checked;});}
function showPicked(){
  var p=picked(); document.getElementById('npicked').textContent=p.length;
  document.getElementById('command').textContent=p.length?commands(p):'';
}
function copy(text,what){
  function done(){status.textContent='Copied '+what+': '+text.split('\n').length+' command'+(text.indexOf('\n')>=0?'s':'');
    document.body.dataset.copied=text;}
  function fallback(){var ta=document.createElement('textarea');ta.value=text;document.body.appendChild(ta);ta.select();
    try{document.execCommand('copy');done();}catch(e){status.textContent='Copy failed: select the command and copy it';}
    ta.remove();}
  if(!text){status.textContent='Pick pages first (their check boxes, or x)';return;}
  if(navigator.clipboard&&navigator.clipboard.writeText){navigator.clipboard.writeText(text).then(done,fallback);}
  else{fallback();}
}
document.addEventListener('change',function(e){if(e.target.matches('input.pick')){showPicked();}});
document.getElementById('copy-picked').addEventListener('click',function(){copy(commands(picked()),'the picked pages');});
document.getElementById('pick-shown').addEventListener('click',function(){
  sections.forEach(function(s){if(!s.hidden){s.querySelector('input.pick').checked=true;}}); showPicked();});
document.getElementById('pick-none').addEventListener('click',function(){
  sections.forEach(function(s){s.querySelector('input.pick').checked=false;}); showPicked();});
sections.forEach(function(s){s.querySelector('button.copy').addEventListener('click',function(){
  copy(commands([s]),'page '+s.dataset.page);});});
// keyboard
var current=-1;
function move(step){
  var vis=sections.filter(function(s){return !s.hidden;}); if(!vis.length){return;}
  var at=vis.indexOf(sections[current]); at=at<0?(step>0?0:vis.length-1):Math.max(0,Math.min(vis.length-1,at+step));
  current=sections.indexOf(vis[at]); vis[at].focus(); vis[at].scrollIntoView({block:'start'});
}
document.addEventListener('keydown',function(e){
  if(e.ctrlKey||e.metaKey||e.altKey||e.target.isContentEditable||/^(INPUT|TEXTAREA|SELECT)$/.test(e.target.tagName)&&e.target.type!=='checkbox'){return;}
  var k=e.key, f={a:'all',g:'good',f:'fair',p:'poor',r:'repaired'}[k];
  if(k==='j'){move(1);}else if(k==='k'){move(-1);}
  else if(k==='x'&&current>=0){var c=sections[current].querySelector('input.pick');c.checked=!c.checked;showPicked();}
  else if(k==='c'){copy(commands(picked()),'the picked pages');}
  else if(f){setFilter(f);}else{return;}
  e.preventDefault();
});
document.addEventListener('focusin',function(e){var s=e.target.closest&&e.target.closest('section.page');
  if(s){current=sections.indexOf(s);}});
applyFilter(); showPicked();
})();
"""

# the review server's additions (ingest.review.server): edit a page's blocks, save, undo, mark checked, queue re-runs;
# every request carries the page's token (X-Uflash-Token) and goes to the page's own origin
LIVE_SCRIPT = r"""
(function(){
var token=document.body.dataset.token, status=document.getElementById('status');
function post(url,body){
  return fetch(url,{method:'POST',headers:{'Content-Type':'application/json','X-Uflash-Token':token},
                    body:JSON.stringify(body||{})})
    .then(function(r){return r.json().then(function(j){if(!r.ok){throw new Error(j.error||r.status);} return j;});});
}
function say(t){status.textContent=t;}
function show(sec,j){
  sec.querySelector(':scope .cols .text').innerHTML=j.text_html;
  var st=sec.querySelector('.state.corrected');
  st.hidden=!j.corrected; st.textContent=j.corrected?'corrected (model CER '+j.cer.toFixed(4)+')':'';
  sec.dataset.corrected=j.corrected?'1':'0';
}
document.querySelectorAll('section.page').forEach(function(sec){
  var id=sec.id.slice(1), before=[];
  var edit=sec.querySelector('button.edit'), save=sec.querySelector('button.save'),
      cancel=sec.querySelector('button.cancel'), undo=sec.querySelector('button.undo'),
      checked=sec.querySelector('input.checked');
  function blocks(){return [].slice.call(sec.querySelectorAll(':scope .cols .text .el[data-n] .words'));}
  function editing(on){
    blocks().forEach(function(b,i){if(on){before[i]=b.innerText;} b.contentEditable=on&&b.closest('.el').dataset.words==='1'?'true':'false';});
    edit.hidden=on; save.hidden=!on; cancel.hidden=!on;
  }
  edit.addEventListener('click',function(){editing(true); var b=blocks().filter(function(b){return b.isContentEditable;})[0]; if(b){b.focus();}});
  cancel.addEventListener('click',function(){blocks().forEach(function(b,i){b.innerText=before[i];}); editing(false);});
  save.addEventListener('click',function(){
    var edits={}, n=0;
    blocks().forEach(function(b,i){if(b.innerText!==before[i]){edits[b.closest('.el').dataset.n]=b.innerText; n++;}});
    if(!n){editing(false); say('nothing changed on page '+sec.dataset.page); return;}
    post('/api/pages/'+id+'/correction',{blocks:edits}).then(function(j){editing(false); show(sec,j);
      say('saved page '+sec.dataset.page+' ('+j.recorded+'); outputs written again');})
      .catch(function(e){say('not saved: '+e.message);});
  });
  undo.addEventListener('click',function(){
    post('/api/pages/'+id+'/undo',{}).then(function(j){editing(false); show(sec,j);
      say('page '+sec.dataset.page+': back to the model\'s reading; outputs written again');})
      .catch(function(e){say('not undone: '+e.message);});
  });
  checked.addEventListener('change',function(){
    post('/api/pages/'+id+'/checked',{checked:checked.checked}).then(function(j){
      sec.querySelector('.state.checked').hidden=!j.checked; say('page '+sec.dataset.page+(j.checked?' checked':' not checked'));})
      .catch(function(e){checked.checked=!checked.checked; say('not saved: '+e.message);});
  });
});
var list=document.getElementById('reruns');
function showReruns(items){
  list.innerHTML=''; items.forEach(function(r){var li=document.createElement('li'); li.dataset.state=r.state;
    li.textContent=r.state+': '+r.what+(r.run?' -> run '+r.run:'')+(r.note?' ('+r.note+')':''); list.appendChild(li);});
}
document.getElementById('rerun-picked').addEventListener('click',function(){
  var ids=[].slice.call(document.querySelectorAll('section.page')).filter(function(s){
    return s.querySelector('input.pick').checked;}).map(function(s){return +s.id.slice(1);});
  if(!ids.length){say('Pick pages first (their check boxes, or x)'); return;}
  post('/api/reruns',{pages:ids}).then(function(j){showReruns(j.reruns); say('re-run queued: '+j.queued.join('; '));})
    .catch(function(e){say('not queued: '+e.message);});
});
setInterval(function(){if(!list.children.length){return;}
  fetch('/api/reruns',{headers:{'X-Uflash-Token':token}}).then(function(r){return r.json();}).then(function(j){showReruns(j.reruns);});},2000);
})();
"""

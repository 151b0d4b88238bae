// Markdown to DOM nodes, safely: model text only ever becomes text nodes (textContent), never
// markup, so a "<script>" or "<img onerror=...>" in an answer shows as the characters it is.
// Links keep only http(s) and mailto targets. Covers what chat models write: paragraphs,
// headings, fenced code (also unclosed, while it streams), lists, quotes, tables, rules, and
// inline code, bold, italic, strike-through and links.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEPARATOR = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function safeUrl(href) {
  try {
    const url = new URL(href, window.location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

// ---- inline

// code | bold | strike | italic | [link](url) | bare URL
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source,
  /\*\*(\S(?:[\s\S]*?\S)?)\*\*/.source,
  /~~(\S(?:[\s\S]*?\S)?)~~/.source,
  /\*(\S(?:[\s\S]*?\S)?)\*/.source,
  /\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?\s*\)/.source,
  /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"\]])/.source,
].join("|"), "g");

export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    last = m.index + m[0].length;
    if (m[1] !== undefined) {
      parent.append(el("code", null, m[2]));
    } else if (m[3] !== undefined) {
      renderInline(m[3], parent.appendChild(el("strong")));
    } else if (m[4] !== undefined) {
      renderInline(m[4], parent.appendChild(el("del")));
    } else if (m[5] !== undefined) {
      renderInline(m[5], parent.appendChild(el("em")));
    } else {
      const label = m[6] ?? m[8];
      const href = safeUrl(m[7] ?? m[8]);
      if (href === null) {          // javascript:, data:, ...: keep the text, drop the link
        parent.append(m[0]);
        continue;
      }
      const a = el("a");
      a.href = href;
      a.target = "_blank";
      a.rel = "noopener noreferrer nofollow";
      if (m[6] !== undefined) renderInline(label, a); else a.textContent = label;
      parent.append(a);
    }
  }
  if (last < text.length) parent.append(text.slice(last));
  return parent;
}

// ---- blocks

function codeBlock(lang, code) {
  const box = el("div", "code-block");
  const head = box.appendChild(el("div", "code-head"));
  head.append(el("span", "code-lang", lang || "text"));
  const copy = head.appendChild(el("button", "copy", "Copy"));
  copy.type = "button";
  copy.addEventListener("click", () => {
    const show = (label) => {
      copy.textContent = label;
      setTimeout(() => { copy.textContent = "Copy"; }, 1500);
    };
    // the clipboard API exists only in secure contexts (https, localhost)
    if (!navigator.clipboard) return show("Select the code to copy it");
    navigator.clipboard.writeText(code).then(() => show("Copied"), () => show("Copy failed"));
  });
  const pre = box.appendChild(el("pre"));
  pre.append(el("code", lang ? `language-${lang}` : null, code));
  return box;
}

function tableCells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(header, separator, rows) {
  const aligns = tableCells(separator).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : null);
  const wrap = el("div", "table-wrap");
  const t = wrap.appendChild(el("table"));
  const addRow = (section, cells, tag) => {
    const tr = section.appendChild(el("tr"));
    aligns.forEach((align, i) => {
      const cell = renderInline(cells[i] ?? "", tr.appendChild(el(tag)));
      if (align) cell.style.textAlign = align;
    });
  };
  addRow(t.appendChild(el("thead")), tableCells(header), "th");
  const body = t.appendChild(el("tbody"));
  for (const row of rows) addRow(body, tableCells(row), "td");
  return wrap;
}

function list(lines, start) {
  // one level deep per call; deeper-indented items nest inside the previous item
  const first = lines[start].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  let item = null;
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(ITEM);
    if (m && m[1].length <= indent + 1) {
      if (/\d/.test(m[2]) !== ordered) break;
      item = node.appendChild(el("li"));
      renderInline(m[3], item);
      i += 1;
    } else if (m && item) {
      const [sub, next] = list(lines, i);
      item.append(sub);
      i = next;
    } else if (line.trim() && /^\s{2,}/.test(line) && item) {   // a continuation line
      item.append("\n");
      renderInline(line.trim(), item);
      i += 1;
    } else {
      break;
    }
  }
  return [node, i];
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_SEPARATOR.test(next));
}

export function renderMarkdown(text, parent) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = line.match(FENCE))) {
      const fence = m[1];
      const closes = (l) => {
        const t = l.trim();
        return t.length >= fence.length && t === fence[0].repeat(t.length);
      };
      const body = [];
      i += 1;
      while (i < lines.length && !closes(lines[i])) body.push(lines[i++]);
      i += 1;                                  // the closing fence (or the end, while streaming)
      parent.append(codeBlock(m[2], body.join("\n")));
    } else if ((m = line.match(HEADING))) {
      parent.append(renderInline(m[2], el(`h${m[1].length}`)));
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      parent.append(renderMarkdown(body.join("\n"), el("blockquote")));
    } else if (ITEM.test(line)) {
      const [node, next] = list(lines, i);
      parent.append(node);
      i = next;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEPARATOR.test(lines[i + 1])) {
      const rows = [];
      let j = i + 2;
      while (j < lines.length && lines[j].includes("|") && lines[j].trim()) rows.push(lines[j++]);
      parent.append(table(line, lines[i + 1], rows));
      i = j;
    } else {
      const body = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) {
        body.push(lines[i]);
        i += 1;
      }
      parent.append(renderInline(body.join("\n"), el("p")));
    }
  }
  return parent;
}

// The OBS overlay: a listener on a channel (/v1/voice?role=listener&channel=NAME). It keeps its
// connection while speaking clients come and go, so the URL set up before the show keeps working.
// URL parameters:
//   channel=main     channel to follow          token=…        the server's shared token
//   pos=bottom|top   where the captions sit     size=44        font size in px (44 reads well at 1080p)
//   width=80         caption width, % of page   hold=4         seconds a caption stays after it ends
//   user=#ffffff, bot=#ffe27a, bg=rgba(0,0,0,.55)             colours (CSS; # may be written %23)
//   userlabel=, botlabel=                       names shown before each caption (none by default)
//   audio=0          show captions only, do not play the voice
import { Player, VoiceSocket, remember, serverUrl } from "/static/voice-client.js";

const params = new URLSearchParams(location.search);
const channel = params.get("channel") || "main";
const holdMs = Number(params.get("hold") ?? 4) * 1000;
const playAudio = params.get("audio") !== "0";

const style = document.documentElement.style;
for (const [param, variable, unit] of [["size", "--size", "px"], ["width", "--width", "%"], ["user", "--user", ""], ["bot", "--bot", ""], ["bg", "--bg", ""]]) {
  if (params.get(param)) style.setProperty(variable, params.get(param) + unit);
}
if (params.get("pos") === "top") document.body.classList.add("top");

class Caption {
  constructor(id, label) {
    this.el = document.getElementById(id);
    this.text = this.el.querySelector(".text");
    this.el.querySelector(".label").textContent = label ?? "";
    this.timer = null;
  }
  show(text) { clearTimeout(this.timer); this.text.textContent = text; this.el.classList.toggle("shown", text !== ""); }
  hideIn(ms) { clearTimeout(this.timer); this.timer = setTimeout(() => this.el.classList.remove("shown"), ms); }
  keep() { clearTimeout(this.timer); }
}

const user = new Caption("user", params.get("userlabel"));
const bot = new Caption("bot", params.get("botlabel"));
const player = new Player({ jitterMs: Number(params.get("jitter") ?? 120) });
const replies = new Map();  // reply_id -> text so far; emptied of older replies at each audio.start
let current = null;  // { id, playing } of the reply whose audio is arriving

// What tests read: counters, and every caption as it was shown.
window.voicebotOverlay = { stats: () => ({ ...player.stats }), userCaptions: [], botCaptions: [], speakerChanges: 0, connected: false };
const overlay = window.voicebotOverlay;

function showBot(text) {
  bot.show(text);
  if (text) remember(overlay.botCaptions, text);
}

player.onFirstFrame = (delayS) => {
  // The caption appears when its voice is heard, not when the frames arrive.
  const reply = current;
  setTimeout(() => {
    if (current !== reply) return;
    reply.playing = true;
    showBot(replies.get(reply.id) ?? "");
  }, delayS * 1000);
};

function onEvent(ev) {
  switch (ev.type) {
    case "listener.ready": overlay.connected = true; socket.connected(); break;
    case "channel.speaker": overlay.speakerChanges++; break;
    case "speech.started": user.show("…"); break;
    case "asr.partial": user.show(ev.text); break;
    case "asr.final":
      if (!ev.text) { user.hideIn(0); break; }
      // Hidden after `hold` unless a reply starts: the question then stays up while it is answered.
      user.show(ev.text); remember(overlay.userCaptions, ev.text); user.hideIn(holdMs);
      break;
    case "reply.delta": {
      const text = (replies.get(ev.reply_id) ?? "") + ev.text;
      replies.set(ev.reply_id, text);
      if (current?.id === ev.reply_id && current.playing) bot.show(text);  // an LLM still writing
      break;
    }
    case "reply.done": replies.set(ev.reply_id, ev.text); break;
    case "audio.start":
      for (const id of replies.keys()) if (id !== ev.reply_id) replies.delete(id);
      current = { id: ev.reply_id, playing: false };
      user.keep();
      // Without playback there is no audio to time the caption to.
      if (!playAudio || player.ctx.state !== "running") showBot(replies.get(ev.reply_id) ?? "");
      break;
    case "audio.end":
      player.endReply();
      bot.hideIn(player.remaining * 1000 + holdMs);
      user.hideIn(player.remaining * 1000 + holdMs);
      break;
    case "audio.interrupted":
      player.stop();
      if (current?.playing) { bot.show(ev.heard_text); bot.hideIn(holdMs); }
      user.hideIn(holdMs);
      current = null;
      break;
  }
}

const socket = new VoiceSocket({
  url: serverUrl("/v1/voice", { role: "listener", channel }),
  token: params.get("token"),
  onEvent,
  onAudio: (buffer) => { if (playAudio) player.push(buffer); },
  onStatus: (text, state) => { overlay.connected = state === "connected"; overlay.status = text; },
});
socket.start();

// OBS's browser source may play audio at once; a normal browser tab needs a click first.
player.resume().finally(() => {
  if (player.ctx.state !== "running" && playAudio) {
    const badge = document.getElementById("sound");
    badge.hidden = false;
    badge.onclick = () => player.resume().then(() => { badge.hidden = true; });
  }
});

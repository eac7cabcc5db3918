%% @private
%% The node-to-node protocol. Pure.
%%
%% Every message convoy sends to a peer's convoy is a tuple
%% `{'$convoy', Version, Kind, ...}'; the version travels in every one of them.
%%
%% <ul>
%% <li>`{'$convoy', 1, batch, FromNode, Entries}' goes from an outbound lane (or from
%%   a sender shipping its own message while its lane is idle) to an inbox
%%   (`convoy_inbox_I'). Entries are delivered in list order:
%%   <ul>
%%   <li>`{To, Msg}': send `Msg' to `To' (a pid or alias of the receiving node, or a
%%     name registered there);</li>
%%   <li>`{[To], Msg}': multicast, `Msg' to each `To' in order. One with two or
%%     more destinations must cost at most `max_entry_words/0' (2^18):
%%     destinations x (the words one local send of `Msg' copies, as
%%     `convoy_size:copy_words/2' counts them, + 32 for the send itself), so at
%%     most `max_dests/0' (8192) destinations. A sender splits a multicast to one
%%     node with `multicast_entries/2', whose entries always pass;</li>
%%   <li>`{'$convoy_publish', Scope, Group, Msg}' (version 2, kind `publish'):
%%     `Msg' to every member of the `pg' group `Group' of scope `Scope' (an atom)
%%     on the receiving node, `pg:get_local_members(Scope, Group)' as the receiver
%%     sees it when it delivers the entry. A scope that does not run there is
%%     counted `undeliverable'. Its cost is known only then (members x the words
%%     of one send + 32, see `send_words/1'): the receiver delivers it in slices
%%     of members (`take_members/3'), within the same budget as any entry;</li>
%%   <li>`{'$convoy_barrier', ReplyTo, Tag}': answer `{Tag, convoy_barrier}' to
%%     `ReplyTo' once everything before it is delivered. `ReplyTo' (a pid or an
%%     alias) must be of `FromNode': an inbox answers only the node the batch says
%%     it came from, never a third one.</li>
%%   <li>Version 2, kind `piece' (`convoy_chunk'): a piece of a message sent in
%%     pieces. The first is `{'$convoy_piece', Ref, 0, Data, {Sender, To, Kind,
%%     Size}}', the others `{'$convoy_piece', Ref, Seq, Data}' with Seq 1, 2, ...;
%%     `Ref' (an alias of the sender, fresh per message) and `Sender' (a pid) must
%%     be of `FromNode', `To' a single destination of the receiving node, `Kind'
%%     `binary' or `term', `Size' the total bytes (positive), `Data' a binary. The
%%     inbox answers `{Ref, convoy_piece, Seq}' for each piece it stored,
%%     `{Ref, convoy_piece, refused}' for a start over its bound and
%%     `{Ref, convoy_piece, delivered}' once the whole message was delivered; a
%%     well-formed piece out of sequence is `bad_piece' (see
%%     `convoy_chunk').</li>
%%   <li>Version 3, kind `piece_path': a start piece's `Kind' may also be
%%     `{path, Path, SkeletonBytes}' (`Path' a list of 1 to 3 positive integers,
%%     `SkeletonBytes' at most `Size'): the message's bytes are its skeleton,
%%     encoded, then a binary to put at `Path' in it (see `convoy_chunk').</li>
%%   <li>Version 3, kind `piece_acks': a start piece may be
%%     `{'$convoy_piece', Ref, 0, Data, {Sender, To, Kind, Size, AckEvery}}'
%%     (`AckEvery' 1 to 1024): the inbox then answers `{Ref, convoy_piece, Seq}'
%%     only for the start and for the pieces whose `Seq rem AckEvery' is
%%     `AckEvery - 1', each answer covering the pieces before it (a 4-element
%%     start asks for every piece).</li>
%%   </ul>
%%   The receiver checks every entry (`entry/3'). A malformed one, a destination
%%   of another node, a barrier for a third node or a multicast or publish of a
%%   message that is itself a batch (to an inbox it would make the inbox feed
%%   itself, each level multiplying the work) is `bad_entry'; a multicast
%%   over a limit is `too_costly'; both are counted and nothing of them is sent.
%%   A pid or alias of an old incarnation of the receiving node (same name,
%%   another `creation', see `creation/1') is counted `undeliverable' and not sent to:
%%   `!' drops such messages silently on the sending node, while a local send on
%%   the receiving node would make the runtime log an error for each one.
%%
%%   A batch has no limit on its number of entries (a sender's `max_batch' is at
%%   most 1,000,000): no entry costs more than `max_entry_words/0', and the
%%   receiver delivers a long batch in slices of that cost (see `convoy_inbox') so
%%   other traffic is not held behind it.</li>
%% <li>Version 4, kind `zbatch': `{'$convoy', 1, zbatch, FromNode, Bin}' is a
%%   batch compressed (`convoy_compress'): `Bin' is `term_to_binary(Entries,
%%   [{compressed, Level}])' of exactly the entries a `batch' would carry. The
%%   receiver decodes it (as distribution decodes: no `safe', the peer is a
%%   connected node) and delivers it as that batch, in arrival order with the
%%   others. A `Bin' that does not decode to a proper list is `bad_compressed':
%%   nothing of it is delivered. A multicast or publish of a message that is
%%   itself a compressed batch is `bad_entry', as one of a batch.</li>
%% <li>Version 5, kind `meter': the entry `{'$convoy_meter', ReplyTo, Tag}' is a
%%   barrier answered `{Tag, convoy_meter, Time}', `Time' the receiver's
%%   `erlang:monotonic_time(microsecond)' once everything before it is delivered:
%%   the times of a sender's meters tell it how fast its batches went through,
%%   whatever it was busy with when the answers came (`convoy_compress_auto').
%%   `ReplyTo' as a barrier's.</li>
%% <li>`{'$convoy', 1, hello | welcome, Info}' goes between `convoy_peers' processes
%%   (the exchange is described in `convoy_peers'). `Info' is a map; unknown keys
%%   are ignored, so a later release can add some before anyone relies on them.
%%   Required: `versions' (protocol versions the sender accepts), `node' (the
%%   sender's node), `peers' (its `convoy_peers' pid, a pid of `node') and `inboxes'
%%   (how many inboxes it runs, 1..`max_inboxes()'). Optional: `request', a
%%   reference. In a `hello' it is a fresh alias of the sender's
%%   `convoy_peers' (a reference of `node'): the `welcome' goes to that alias and
%%   carries it back as its own `request'. Only a `welcome' whose `request' is one
%%   the receiver is waiting on, from the node it asked, is learnt from; a `hello'
%%   only prompts the receiver to ask that node itself.</li>
%% </ul>
%% A receiver accepts every version in `versions/0'; a sender uses the highest
%% version both sides accept, learnt from the hello exchange. Version 2 keeps
%% version 1's messages as they are (a batch's envelope still says 1, so a
%% version-1 peer reads every batch it is sent) and adds entry kinds, listed with
%% the entries above, that a sender puts only in batches for a peer whose
%% negotiated version is 2 or more (`supports/2'); version 3 adds a kind of start
%% piece in the same way, version 4 the compressed batch, a message a lane
%% sends only to a peer whose negotiated version is 4 or more, and version 5 the
%% meter entry.
%%
%% The limits on a multicast entry bound the work one entry costs its receiver
%% (a few milliseconds at `max_entry_words/0'): a send that wakes a waiting
%% process costs about as much as copying 32 words. The destination limit is what
%% the budget allows with nothing to copy; it also bounds the check's walk of the
%% list, so an entry with a million destinations is rejected after reading 8193
%% (doc/decisions.md, "A multicast entry's work is bounded").
-module(convoy_wire).

-export([version/0, versions/0, max_inboxes/0, max_dests/0, max_entry_words/0,
         batch/2, zbatch/2, barrier/2, meter/2, publish/3, piece_start/6, piece_start/7, piece/3, hello/2,
         supports/2,
         address/2, send_words/1, take_members/3, entry_to/3, decode/1, entry/3, cost/1, send_cost/0,
         multicast_entries/2, multicast_entries/3, per_entry/1, current_by_form/1,
         creation/1, incarnation/2, negotiate/1, inbox_name/1, inbox_names/1, lane_inbox/2]).

-export_type([entry_kind/0, entry/0, dest/0, decoded/0, hello_info/0, checked/0]).

-include("convoy_tags.hrl").
-include("convoy_limits.hrl").

%% The newest version this release speaks, and the one a batch's envelope carries
%% (unchanged since version 1).
-define(VSN, 5).
-define(BATCH_VSN, 1).
%% Any batch, plain (`batch/2') or compressed (`zbatch/2'), as a pattern of kind
%% `Kind' and the guard on it: a message that is one is refused in a multicast or
%% publish entry (`entry/3', `entry_to/3').
-define(ANY_BATCH(Kind), {?TAG_WIRE, _, Kind, _, _}).
-define(IS_BATCH(Kind), (Kind =:= batch orelse Kind =:= zbatch)).
-define(MAX_INBOXES, ?MAX_LANES).
%% A start piece's acknowledgement interval: at most the largest `chunk_window'.
-define(MAX_ACK_EVERY, ?MAX_CHUNK_WINDOW).
-define(MAX_ENTRY_WORDS, (1 bsl 18)).
%% What one local send costs beyond the words it copies, in word copies (a send
%% that wakes a waiting process takes about as long as copying 32 words).
-define(SEND_WORDS, 32).
-define(MAX_DESTS, (?MAX_ENTRY_WORDS div ?SEND_WORDS)).

-type dest() :: pid() | atom() | reference().
-type entry_kind() :: publish | piece | piece_path | piece_acks | zbatch | meter.
%% An entry or message kind added after version 1 (see `supports/2').
-type entry() :: {dest() | [dest()], term()} | {?TAG_BARRIER, pid() | reference(), term()}
               | {?TAG_METER, pid() | reference(), term()}
               | {?TAG_PUBLISH, atom(), term(), term()}
               | {?TAG_PIECE, reference(), pos_integer(), binary()}
               | {?TAG_PIECE, reference(), 0, binary(),
                  {pid(), dest(), convoy_chunk:kind(), pos_integer()}}
               | {?TAG_PIECE, reference(), 0, binary(),
                  {pid(), dest(), convoy_chunk:kind(), pos_integer(), pos_integer()}}.
-type hello_info() :: #{versions := [pos_integer()], node := node(), peers := pid(),
                        inboxes := pos_integer(), request => reference()}.
-type decoded() :: {batch, pos_integer(), node(), maybe_improper_list()}
                 | {zbatch, pos_integer(), node(), term()}
                 | {hello | welcome, hello_info()}
                 | {error, bad_version | malformed_batch | bad_hello | unknown_message}.
-type checked() :: {deliver, dest(), term()}
                 | {multicast, [dest()], term(), non_neg_integer()}
                 | {barrier, pid() | reference(), term()}
                 | {meter, pid() | reference(), term()}
                 | {publish, atom(), term(), term()}
                 | {piece_start, #{ref := reference(), sender := pid(), to := dest(),
                                   kind := convoy_chunk:kind(), size := pos_integer(),
                                   ack_every := pos_integer(), data := binary()}}
                 | {piece, reference(), pos_integer(), binary()}
                 | {error, bad_entry | too_costly}.

-spec version() -> pos_integer().
version() -> ?VSN.

%% @doc Versions this release accepts.
-spec versions() -> [pos_integer()].
versions() -> [1, 2, 3, 4, ?VSN].

%% @doc Whether a peer that negotiated version `Vsn' reads entries (or messages)
%% of `Kind'.
-spec supports(pos_integer(), entry_kind()) -> boolean().
supports(Vsn, Kind) -> Vsn >= since(Kind).

%% Entry kinds added after version 1 and the version that added them.
since(publish) -> 2;
since(piece) -> 2;
since(piece_path) -> 3;
since(piece_acks) -> 3;
since(zbatch) -> 4;
since(meter) -> 5.

-spec max_inboxes() -> pos_integer().
max_inboxes() -> ?MAX_INBOXES.

%% @doc Most destinations in one multicast entry.
-spec max_dests() -> pos_integer().
max_dests() -> ?MAX_DESTS.

%% @doc Most a multicast entry with two or more destinations may cost (see `cost/1').
-spec max_entry_words() -> pos_integer().
max_entry_words() -> ?MAX_ENTRY_WORDS.

%% @doc What `erlang:send/2' takes for destination `To' (of an entry) on `Node':
%% a name goes with its node, a pid or alias alone.
-spec address(dest(), node()) -> pid() | reference() | {atom(), node()}.
address(Name, Node) when is_atom(Name) -> {Name, Node};
address(PidOrRef, _Node) -> PidOrRef.

-spec batch(node(), [entry()]) -> tuple().
batch(FromNode, Entries) -> {?TAG_WIRE, ?BATCH_VSN, batch, FromNode, Entries}.

%% @doc A compressed batch (version 4): `Bin' encodes the entries (`convoy_compress').
-spec zbatch(node(), binary()) -> tuple().
zbatch(FromNode, Bin) -> {?TAG_WIRE, ?BATCH_VSN, zbatch, FromNode, Bin}.

%% @doc A publish entry (version 2): `Msg' to the receiving node's members of
%% `Group' in the `pg' scope `Scope'.
-spec publish(atom(), term(), term()) -> entry().
publish(Scope, Group, Msg) -> {?TAG_PUBLISH, Scope, Group, Msg}.

-spec barrier(pid() | reference(), term()) -> entry().
barrier(ReplyTo, Tag) -> {?TAG_BARRIER, ReplyTo, Tag}.

%% @doc A meter (version 5): a barrier answered with the receiver's time.
-spec meter(pid() | reference(), term()) -> entry().
meter(ReplyTo, Tag) -> {?TAG_METER, ReplyTo, Tag}.

%% @doc The first piece of a message sent in pieces (version 2, see `convoy_chunk').
-spec piece_start(reference(), pid(), dest(), convoy_chunk:kind(), pos_integer(), binary()) ->
          entry().
piece_start(Ref, Sender, To, Kind, Size, Data) ->
    {?TAG_PIECE, Ref, 0, Data, {Sender, To, Kind, Size}}.

%% @doc The first piece, asking for an acknowledgement every `AckEvery' pieces
%% (version 3, kind `piece_acks').
-spec piece_start(reference(), pid(), dest(), convoy_chunk:kind(), pos_integer(),
                  pos_integer(), binary()) -> entry().
piece_start(Ref, Sender, To, Kind, Size, AckEvery, Data) ->
    {?TAG_PIECE, Ref, 0, Data, {Sender, To, Kind, Size, AckEvery}}.

%% @doc Piece `Seq' (1, 2, ...) of a message sent in pieces (version 2).
-spec piece(reference(), pos_integer(), binary()) -> entry().
piece(Ref, Seq, Data) -> {?TAG_PIECE, Ref, Seq, Data}.

-spec hello(hello | welcome, hello_info()) -> tuple().
hello(Kind, Info) -> {?TAG_WIRE, ?BATCH_VSN, Kind, Info}.

%% @doc Classify anything that arrived at a convoy process from outside.
-spec decode(term()) -> decoded().
decode({?TAG_WIRE, Vsn, Kind, From, Payload}) when is_integer(Vsn), ?IS_BATCH(Kind) ->
    %% Every version so far writes the batch envelope of version 1. A compressed
    %% batch's payload is decoded by its receiver (`convoy_compress:decode/1').
    case Vsn =:= ?BATCH_VSN of
        false -> {error, bad_version};
        true when is_atom(From), Kind =:= zbatch -> {zbatch, Vsn, From, Payload};
        true when is_atom(From), is_list(Payload) -> {batch, Vsn, From, Payload};
        true -> {error, malformed_batch}
    end;
decode({?TAG_WIRE, Vsn, Kind, Info}) when Kind =:= hello; Kind =:= welcome ->
    case is_integer(Vsn) andalso valid_hello(Info) andalso valid_request(Kind, Info) of
        true -> {Kind, Info};
        false -> {error, bad_hello}
    end;
decode({?TAG_WIRE, _, _, _, _}) ->
    {error, malformed_batch};
decode({?TAG_WIRE, _, _, _}) ->
    {error, bad_hello};
decode(_) ->
    {error, unknown_message}.

valid_hello(#{versions := Vs, node := N, peers := P, inboxes := I}) ->
    valid_versions(Vs) andalso is_atom(N) andalso is_pid(P) andalso node(P) =:= N
        andalso is_integer(I) andalso I >= 1 andalso I =< ?MAX_INBOXES;
valid_hello(_) ->
    false.

%% A hello's request is an alias on the sender's node; a welcome's echoes one of
%% the receiver's (checked there against what it is waiting on).
valid_request(hello, #{request := R, node := N}) -> is_reference(R) andalso node(R) =:= N;
valid_request(welcome, #{request := R}) -> is_reference(R);
valid_request(_Kind, _Info) -> true.

valid_versions([V]) -> is_integer(V) andalso V > 0;
valid_versions([V | Rest]) -> is_integer(V) andalso V > 0 andalso valid_versions(Rest);
valid_versions(_) -> false.

%% @doc The highest version both sides accept, or `none'.
-spec negotiate([pos_integer()]) -> pos_integer() | none.
negotiate(Theirs) ->
    case [V || V <- versions(), lists:member(V, Theirs)] of
        [] -> none;
        Common -> lists:max(Common)
    end.

%% @doc Check one entry of a batch from `From' on the receiving node `Local'. A
%% multicast's check visits at most its first 8193 destinations and about
%% `max_entry_words/0' / destinations words of its message.
-spec entry(term(), node(), node()) -> checked().
entry({Tos, ?ANY_BATCH(K)}, _From, _Local) when is_list(Tos), ?IS_BATCH(K) ->
    %% A batch multicast (or published) to an inbox would make it feed itself:
    %% multicasts of batches of multicasts multiply the work of one input with
    %% every level. A message shaped as a batch in a plain entry is delivered
    %% (any term is a message): to an inbox, it is a smaller input than the one
    %% that carried it, as its sender could have sent it there itself.
    {error, bad_entry};
entry({?TAG_PUBLISH, _Scope, _Group, ?ANY_BATCH(K)}, _From, _Local) when ?IS_BATCH(K) ->
    {error, bad_entry}; % as above
entry({?TAG_PUBLISH, Scope, Group, Msg}, _From, _Local) when is_atom(Scope) ->
    {publish, Scope, Group, Msg};
entry({Answered, ReplyTo, Tag}, From, _Local)
  when (Answered =:= ?TAG_BARRIER orelse Answered =:= ?TAG_METER)
       andalso (is_pid(ReplyTo) orelse is_reference(ReplyTo)) ->
    case node(ReplyTo) =:= From of
        true when Answered =:= ?TAG_BARRIER -> {barrier, ReplyTo, Tag};
        true -> {meter, ReplyTo, Tag};
        false -> {error, bad_entry}
    end;
entry({?TAG_PIECE, Ref, 0, Data, {Sender, To, Kind, Size}}, From, Local) ->
    entry({?TAG_PIECE, Ref, 0, Data, {Sender, To, Kind, Size, 1}}, From, Local);
entry({?TAG_PIECE, Ref, 0, Data, {Sender, To, Kind, Size, AckEvery}}, From, Local)
  when is_reference(Ref), is_binary(Data), is_pid(Sender), is_integer(Size), Size > 0,
       is_integer(AckEvery), AckEvery >= 1, AckEvery =< ?MAX_ACK_EVERY, not is_list(To) ->
    case node(Ref) =:= From andalso node(Sender) =:= From andalso piece_kind(Kind, Size)
        andalso local_dest(To, Local) of
        true -> {piece_start, #{ref => Ref, sender => Sender, to => To, kind => Kind,
                                size => Size, ack_every => AckEvery, data => Data}};
        false -> {error, bad_entry}
    end;
entry({?TAG_PIECE, Ref, Seq, Data}, From, _Local)
  when is_reference(Ref), is_integer(Seq), Seq > 0, is_binary(Data) ->
    case node(Ref) =:= From of
        true -> {piece, Ref, Seq, Data};
        false -> {error, bad_entry}
    end;
entry({To, Msg}, _From, Local) when is_list(To) ->
    case dests(To, Local, 0) of
        {ok, N} when N =< 1 ->
            {multicast, To, Msg, ?SEND_WORDS};
        {ok, N} ->
            case convoy_size:copy_words(Msg, ?MAX_ENTRY_WORDS div N - ?SEND_WORDS) of
                {ok, W} -> {multicast, To, Msg, N * (W + ?SEND_WORDS)};
                over -> {error, too_costly}
            end;
        Error ->
            {error, Error}
    end;
entry({To, Msg}, _From, Local) ->
    case local_dest(To, Local) of
        true -> {deliver, To, Msg};
        false -> {error, bad_entry}
    end;
entry(_, _From, _Local) ->
    {error, bad_entry}.

%% @doc Check an entry that may go to exactly the `N' (two or more) destinations
%% `Tos' of a multicast entry already checked (`entry/3'): `{multicast, ...}' as
%% `entry/3' would answer if it does (only its message is looked at: a batch is a
%% bad entry, a costly one too costly), `other' if it is anything else (then
%% `entry/3' checks it). Compares up to the whole of `Tos'.
-spec entry_to(term(), [dest()], pos_integer()) -> checked() | other.
entry_to({Tos, ?ANY_BATCH(K)}, Tos, _N) when ?IS_BATCH(K) ->
    {error, bad_entry};
entry_to({Tos, Msg}, Tos, N) when N >= 2 ->
    case convoy_size:copy_words(Msg, ?MAX_ENTRY_WORDS div N - ?SEND_WORDS) of
        {ok, W} -> {multicast, Tos, Msg, N * (W + ?SEND_WORDS)};
        over -> {error, too_costly}
    end;
entry_to(_E, _Tos, _N) ->
    other.

%% How many destinations, all local; an improper list is a bad entry, and the walk
%% ends after max_dests + 1.
dests([], _Local, N) -> {ok, N};
dests([_ | _], _Local, N) when N >= ?MAX_DESTS -> too_costly;
dests([D | Rest], Local, N) ->
    case local_dest(D, Local) of
        true -> dests(Rest, Local, N + 1);
        false -> bad_entry
    end;
dests(_, _Local, _N) -> bad_entry.

%% A start piece's kind (`convoy_chunk:kind()'): a path of 1 to `?PATH_DEPTH'
%% tuple indices and a skeleton within the message's size.
piece_kind(binary, _Size) -> true;
piece_kind(term, _Size) -> true;
piece_kind({path, [_ | _] = Path, SkeletonBytes}, Size)
  when is_integer(SkeletonBytes), SkeletonBytes >= 0, SkeletonBytes =< Size,
       length(Path) =< ?PATH_DEPTH ->
    lists:all(fun(I) -> is_integer(I) andalso I > 0 end, Path);
piece_kind(_Kind, _Size) -> false.

local_dest(D, Local) when is_pid(D); is_reference(D) -> node(D) =:= Local;
local_dest(D, _Local) -> is_atom(D) andalso D =/= undefined.

%% @doc The inbox, among a peer's `Inboxes', that lane `Lane' always ships to.
-spec lane_inbox(pos_integer(), tuple()) -> atom().
lane_inbox(Lane, Inboxes) -> element((Lane - 1) rem tuple_size(Inboxes) + 1, Inboxes).

%% @doc What delivering a checked entry costs its receiver, in word copies: a
%% multicast as `entry/3' computed it (32 with fewer than two destinations),
%% anything else the 32 of one send (a single send copies its message once: no
%% more than what travelled, so it is not measured). For a publish entry that is
%% the cost of looking its members up; its sends are paid slice by slice
%% (`take_members/3').
-spec cost(checked()) -> non_neg_integer().
cost({multicast, _Tos, _Msg, Cost}) -> Cost;
cost(_) -> ?SEND_WORDS.

%% @doc What `cost/1' says of an entry that is one send.
-spec send_cost() -> pos_integer().
send_cost() -> ?SEND_WORDS.

%% @doc What one local send of `Msg' costs its receiver, in word copies (the words
%% it copies + 32), at most `max_entry_words/0' (a slice sends at least once). Walks
%% at most about `max_entry_words/0' words of `Msg'.
-spec send_words(term()) -> pos_integer().
send_words(Msg) ->
    case convoy_size:copy_words(Msg, ?MAX_ENTRY_WORDS - ?SEND_WORDS) of
        {ok, W} -> W + ?SEND_WORDS;
        over -> ?MAX_ENTRY_WORDS
    end.

%% @doc The members a slice with `Left' of its budget still to spend delivers to,
%% each send costing `Each' (`send_words/1'), and the members left for later
%% slices: as many as fit, and at least one when the whole budget is left
%% (`Left' = `max_entry_words/0'), so every slice makes progress.
-spec take_members(list(), pos_integer(), non_neg_integer()) -> {list(), list()}.
take_members(Members, Each, Left) ->
    K = case Left div Each of
            0 when Left >= ?MAX_ENTRY_WORDS -> 1;
            Fit -> Fit
        end,
    case ends_within(Members, K) of
        true -> {Members, []}; % the usual case: all of them, not copied
        false -> take_proper(Members, K, [])
    end.

%% A proper list of at most K elements (walks at most K + 1 cells).
ends_within([], _K) -> true;
ends_within([_ | Rest], K) when K > 0 -> ends_within(Rest, K - 1);
ends_within(_, _K) -> false.

take_proper([M | Rest], K, Acc) when K > 0 -> take_proper(Rest, K - 1, [M | Acc]);
take_proper(Rest, _K, Acc) when is_list(Rest) -> {lists:reverse(Acc), Rest};
take_proper(_ImproperTail, _K, Acc) -> {lists:reverse(Acc), []}.

%% @doc A multicast of `Msg' to destinations of one node, as entries the receiver
%% accepts (`entry/3'), destinations in order: as many per entry as the limits
%% allow, one if a single send of `Msg' is already over half of them. Walks at most
%% about `max_entry_words/0' / 2 words of `Msg'.
-spec multicast_entries([dest()], term()) -> [{[dest()], term()}].
multicast_entries(Tos, Msg) ->
    multicast_entries(Tos, Msg, per_entry(Msg)).

%% @doc How many destinations one multicast entry of `Msg' may hold (see
%% `multicast_entries/2'): measured once for a multicast to several nodes.
-spec per_entry(term()) -> pos_integer().
per_entry(Msg) ->
    case convoy_size:copy_words(Msg, ?MAX_ENTRY_WORDS div 2 - ?SEND_WORDS) of
        {ok, W} -> min(?MAX_DESTS, ?MAX_ENTRY_WORDS div (W + ?SEND_WORDS));
        over -> 1
    end.

%% @doc `multicast_entries/2' with `per_entry(Msg)' given.
-spec multicast_entries([dest()], term(), pos_integer()) -> [{[dest()], term()}].
multicast_entries([], _Msg, _PerEntry) ->
    [];
multicast_entries([_] = Tos, Msg, _PerEntry) ->
    [{Tos, Msg}];
multicast_entries(Tos, Msg, PerEntry) ->
    case length(Tos) =< PerEntry of
        true -> [{Tos, Msg}]; % one entry: the list as it is, not copied
        false -> [{Chunk, Msg} || Chunk <- chunks(Tos, PerEntry)]
    end.

chunks([], _N) ->
    [];
chunks(L, N) ->
    {Chunk, Rest} = take(L, N, []),
    [Chunk | chunks(Rest, N)].

take(Rest, 0, Acc) -> {lists:reverse(Acc), Rest};
take([], _N, Acc) -> {lists:reverse(Acc), []};
take([H | T], N, Acc) -> take(T, N - 1, [H | Acc]).

%% @doc Whether a pid or reference of this node belongs to the incarnation
%% `Creation' (`erlang:system_info(creation)'): `current', `old', or `unknown'
%% (`creation/1'). A pid of this incarnation is an immediate term (no heap words,
%% `erts_debug:flat_size/1' 0, as the Efficiency Guide describes it), one of an old
%% incarnation is not: so the pids of a multicast are told apart without encoding
%% each (`creation/1', about six times the cost), and only the others are read.
-spec incarnation(pid() | reference(), non_neg_integer()) -> current | old | unknown.
incarnation(Pid, Creation) when is_pid(Pid) ->
    case current_by_form(Pid) of
        true -> current;
        false -> by_creation(Pid, Creation)
    end;
incarnation(Ref, Creation) ->
    by_creation(Ref, Creation).

%% @doc Whether a pid of this node is of its current incarnation, by its form
%% alone (`incarnation/2'): such a pid is an immediate term.
-spec current_by_form(pid()) -> boolean().
current_by_form(Pid) -> erts_debug:flat_size(Pid) =:= 0.

by_creation(Id, Creation) ->
    case creation(Id) of
        Creation -> current;
        unknown -> unknown;
        _Other -> old
    end.

%% @doc The `creation' of the node incarnation a pid or reference belongs to, read
%% from its external format (NEW_PID_EXT: the last 4 bytes; NEWER_REFERENCE_EXT:
%% the 4 bytes after the node name). `unknown' for any other encoding (none on
%% OTP 25 or later). A pid or reference of this node whose creation is not
%% `erlang:system_info(creation)' belongs to an old incarnation of it.
-spec creation(pid() | reference()) -> non_neg_integer() | unknown.
creation(Id) ->
    case term_to_binary(Id) of
        <<131, 88, _/binary>> = B ->
            Skip = byte_size(B) - 4,
            <<_:Skip/binary, C:32>> = B,
            C;
        <<131, 90, Len:16, _/binary>> = B ->
            Skip = byte_size(B) - 4 * Len - 4,
            <<_:Skip/binary, C:32, _/binary>> = B,
            C;
        _ ->
            unknown
    end.

-spec inbox_name(pos_integer()) -> atom().
inbox_name(I) -> list_to_atom("convoy_inbox_" ++ integer_to_list(I)).

%% @doc Names of a peer's inboxes, 1..N; N is bounded by `max_inboxes/0' so a peer
%% cannot make this node create atoms without limit.
-spec inbox_names(pos_integer()) -> tuple().
inbox_names(N) when N >= 1, N =< ?MAX_INBOXES ->
    list_to_tuple([inbox_name(I) || I <- lists:seq(1, N)]).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

decode_batch_test() ->
    B = batch(a@h, [{self(), hi}]),
    ?assertMatch({batch, 1, a@h, [_]}, decode(B)),
    %% Version 2 writes version 1's envelope: no batch says 2.
    ?assertEqual({error, bad_version}, decode({'$convoy', 2, batch, a@h, []})),
    %% a compressed batch's envelope is checked here, its payload by convoy_compress
    ?assertEqual({zbatch, 1, a@h, x}, decode({'$convoy', 1, zbatch, a@h, x})),
    ?assertEqual({error, bad_version}, decode({'$convoy', 4, zbatch, a@h, <<>>})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', 1, zbatch, "a", <<>>})).

decode_rejects_test() ->
    ?assertEqual({error, bad_version}, decode({'$convoy', 99, batch, a@h, []})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', 1, batch, a@h, notalist})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', 1, batch, "a", []})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', x, y, z, w})),
    ?assertEqual({error, bad_hello}, decode({'$convoy', 1, hello, #{}})),
    ?assertEqual({error, unknown_message}, decode(hello)).

hello_roundtrip_test() ->
    Info = #{versions => [1], node => node(), peers => self(), inboxes => 2, extra => x},
    ?assertEqual({hello, Info}, decode(hello(hello, Info))),
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{inboxes := 5000}))).

hello_request_test() ->
    Info = #{versions => [1], node => node(), peers => self(), inboxes => 2},
    Ref = make_ref(),
    ?assertEqual({hello, Info#{request => Ref}}, decode(hello(hello, Info#{request => Ref}))),
    ?assertEqual({welcome, Info#{request => Ref}}, decode(hello(welcome, Info#{request => Ref}))),
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{request => x}))),
    ?assertEqual({error, bad_hello}, decode(hello(welcome, Info#{request => self()}))),
    %% A hello's request must be a reference of the node the hello claims.
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{request => ref_of(other@host)}))),
    ?assertMatch({welcome, _}, decode(hello(welcome, Info#{request => ref_of(other@host)}))).

%% A reference of another node, as if it had arrived from there.
ref_of(Node) ->
    N = atom_to_binary(Node, utf8),
    binary_to_term(<<131, 90, 3:16, 119, (byte_size(N)), N/binary, 1:32, 11:32, 22:32, 33:32>>).

entry_test() ->
    L = node(),
    F = from@host,
    ?assertEqual({deliver, self(), m}, entry({self(), m}, F, L)),
    ?assertEqual({deliver, foo, m}, entry({foo, m}, F, L)),
    ?assertEqual({error, bad_entry}, entry({undefined, m}, F, L)),
    ?assertEqual({error, bad_entry}, entry({1, m}, F, L)),
    ?assertEqual({multicast, [self(), foo], m, 2 * 32}, entry({[self(), foo], m}, F, L)),
    ?assertEqual({multicast, [foo], m, 32}, entry({[foo], m}, F, L)),
    ?assertEqual({error, bad_entry}, entry({[self(), 1], m}, F, L)),
    ?assertEqual({error, bad_entry}, entry({[self() | foo], m}, F, L)),
    ?assertEqual({error, bad_entry}, entry({self(), m}, F, other@host)),
    ?assertEqual({error, bad_entry}, entry({a, b, c}, F, L)).

%% A barrier answers only the node the batch came from.
barrier_entry_test() ->
    L = node(),
    ?assertMatch({barrier, _, t}, entry(barrier(self(), t), L, other@host)),
    ?assertMatch({barrier, _, t}, entry(barrier(alias(), t), L, other@host)),
    ?assertEqual({error, bad_entry}, entry(barrier(self(), t), from@host, other@host)),
    ?assertEqual({error, bad_entry}, entry(barrier(make_ref(), t), from@host, other@host)),
    ?assertEqual({error, bad_entry}, entry({'$convoy_barrier', foo, t}, L, other@host)),
    %% a meter (version 5) likewise
    ?assertMatch({meter, _, t}, entry(meter(self(), t), L, other@host)),
    ?assertEqual({error, bad_entry}, entry(meter(self(), t), from@host, other@host)),
    ?assertEqual({error, bad_entry}, entry({'$convoy_meter', foo, t}, L, other@host)),
    ?assert(supports(5, meter) andalso not supports(4, meter)).

multicast_limits_test() ->
    L = node(),
    Max = lists:duplicate(?MAX_DESTS, foo),
    ?assertMatch({multicast, _, m, _}, entry({Max, m}, a@h, L)),
    ?assertEqual({error, too_costly}, entry({[foo | Max], m}, a@h, L)),
    %% a bad destination among the first 8192 is a bad entry; past them, too costly
    ?assertEqual({error, bad_entry}, entry({[1 | Max], m}, a@h, L)),
    ?assertEqual({error, too_costly}, entry({Max ++ [1], m}, a@h, L)),
    ?assertEqual({error, bad_entry}, entry({Max ++ x, m}, a@h, L)),
    Big = lists:seq(1, ?MAX_ENTRY_WORDS div 4), % half the budget
    ?assertMatch({multicast, _, _, _}, entry({[foo], Big}, a@h, L)),
    ?assertMatch({multicast, _, _, _}, entry({[foo], {Big, Big, Big}}, a@h, L)),
    ?assertEqual({error, too_costly}, entry({[foo, foo], Big}, a@h, L)),
    %% two sends of 2^17 - 32 words each: exactly the budget
    Ok = lists:seq(1, ?MAX_ENTRY_WORDS div 4 - ?SEND_WORDS div 2),
    ?assertEqual({multicast, [foo, foo], Ok, ?MAX_ENTRY_WORDS}, entry({[foo, foo], Ok}, a@h, L)),
    ?assertEqual({error, too_costly}, entry({[foo, foo], [0 | Ok]}, a@h, L)).

%% The reported entry: a million destinations and a 100,000-deep term.
huge_entry_rejected_at_once_test() ->
    Deep = lists:foldl(fun(_, Acc) -> [Acc] end, [], lists:seq(1, 100000)),
    E = {lists:duplicate(1000000, self()), Deep},
    {T, R} = timer:tc(fun() -> entry(E, a@h, node()) end),
    ?assertEqual({error, too_costly}, R),
    ?assert(T < 100000),
    %% 200,000 words: too costly for two destinations; half that is not
    ?assertEqual({error, too_costly}, entry({[self(), self()], Deep}, a@h, node())),
    Half = lists:foldl(fun(_, Acc) -> [Acc] end, [], lists:seq(1, 50000)),
    ?assertMatch({multicast, _, _, _}, entry({[self(), self()], Half}, a@h, node())).

multicast_entries_test() ->
    ?assertEqual([], multicast_entries([], m)),
    ?assertEqual([{[a], m}], multicast_entries([a], m)),
    ?assertEqual([{[a, b, c], m}], multicast_entries([a, b, c], m)),
    Tos = [list_to_atom("d" ++ integer_to_list(I rem 100)) || I <- lists:seq(1, 20000)],
    Es = multicast_entries(Tos, m),
    ?assertEqual([8192, 8192, 20000 - 2 * 8192], [length(T) || {T, _} <- Es]),
    %% 2^18 div (1000 words + 32) per entry
    Es2 = multicast_entries(Tos, lists:seq(1, 500)),
    ?assertEqual(254, length(element(1, hd(Es2)))),
    ?assertEqual(Tos, lists:append([T || {T, _} <- Es2])),
    ?assertEqual(Tos, lists:append([T || {T, _} <- Es])),
    Big = lists:seq(1, ?MAX_ENTRY_WORDS), % over half the budget: one per entry
    ?assertEqual([{[a], Big}, {[b], Big}], multicast_entries([a, b], Big)).

creation_test() ->
    C = erlang:system_info(creation),
    ?assertEqual(C, creation(self())),
    ?assertEqual(C, creation(make_ref())),
    ?assertEqual(C, creation(alias())),
    N = atom_to_binary(node()),
    Old = binary_to_term(<<131, 88, 119, (byte_size(N)), N/binary, 1:32, 0:32, (C + 1):32>>),
    ?assertEqual(C + 1, creation(Old)),
    OldRef = binary_to_term(<<131, 90, 3:16, 119, (byte_size(N)), N/binary, (C + 7):32,
                              1:32, 2:32, 3:32>>),
    ?assertEqual(C + 7, creation(OldRef)).

incarnation_test() ->
    C = erlang:system_info(creation),
    ?assertEqual(current, incarnation(self(), C)),
    ?assertEqual(current, incarnation(make_ref(), C)),
    ?assertEqual(current, incarnation(alias(), C)),
    N = atom_to_binary(node()),
    Pid = fun(Cr) -> binary_to_term(<<131, 88, 119, (byte_size(N)), N/binary, 1:32, 0:32,
                                      Cr:32>>) end,
    %% decoded with this incarnation's creation: the same immediate pid
    ?assertEqual(current, incarnation(Pid(C), C)),
    ?assertEqual(old, incarnation(Pid(C + 1), C)),
    OldRef = binary_to_term(<<131, 90, 3:16, 119, (byte_size(N)), N/binary, (C + 7):32,
                              1:32, 2:32, 3:32>>),
    ?assertEqual(old, incarnation(OldRef, C)),
    %% a dead process of this incarnation is current (`!' to it is dropped, not counted)
    Dead = spawn(fun() -> ok end),
    Mon = erlang:monitor(process, Dead),
    receive {'DOWN', Mon, process, Dead, _} -> ok end,
    ?assertEqual(current, incarnation(Dead, C)).

publish_entry_test() ->
    L = node(),
    ?assertEqual({publish, pg, g, m}, entry(publish(pg, g, m), a@h, L)),
    ?assertEqual({publish, pg, {any, "group"}, m}, entry(publish(pg, {any, "group"}, m), a@h, L)),
    ?assertEqual({error, bad_entry}, entry({'$convoy_publish', "pg", g, m}, a@h, L)),
    ?assertEqual({error, bad_entry}, entry({'$convoy_publish', pg, g}, a@h, L)),
    %% a batch as the message would make the inbox feed itself
    ?assertEqual({error, bad_entry}, entry(publish(pg, g, batch(a@h, [{self(), x}])), a@h, L)),
    ?assertEqual({error, bad_entry}, entry(publish(pg, g, zbatch(a@h, <<>>)), a@h, L)),
    ?assertEqual({error, bad_entry}, entry({[self()], zbatch(a@h, <<>>)}, a@h, L)),
    ?assert(supports(2, publish)),
    ?assertNot(supports(1, publish)),
    ?assertEqual(?SEND_WORDS, cost({publish, pg, g, m})).

entry_to_test() ->
    L = node(),
    Tos = [self(), foo],
    {multicast, Tos, m, C} = entry({Tos, m}, a@h, L),
    ?assertEqual({multicast, Tos, m2, C}, entry_to({Tos, m2}, Tos, 2)),
    ?assertEqual(entry({Tos, {x, y}}, a@h, L), entry_to({[self(), foo], {x, y}}, Tos, 2)),
    ?assertEqual(other, entry_to({[foo, self()], m}, Tos, 2)),
    ?assertEqual(other, entry_to({[self()], m}, Tos, 2)),
    ?assertEqual(other, entry_to({self(), m}, Tos, 2)),
    ?assertEqual(other, entry_to(publish(pg, g, m), Tos, 2)),
    ?assertEqual(other, entry_to(x, Tos, 2)),
    ?assertEqual({error, bad_entry}, entry_to({Tos, batch(a@h, [])}, Tos, 2)),
    ?assertEqual({error, bad_entry}, entry_to({Tos, zbatch(a@h, <<>>)}, Tos, 2)),
    Big = lists:seq(1, ?MAX_ENTRY_WORDS div 2),
    ?assertEqual({error, too_costly}, entry_to({Tos, Big}, Tos, 2)),
    ?assertEqual(entry({Tos, Big}, a@h, L), entry_to({Tos, Big}, Tos, 2)).

take_members_test() ->
    Each = 1000,
    Budget = ?MAX_ENTRY_WORDS,
    Ms = lists:seq(1, 1000),
    {A, RestA} = take_members(Ms, Each, Budget),
    ?assertEqual(Budget div Each, length(A)),
    ?assertEqual(Ms, A ++ RestA),
    %% nothing fits in a slice's last words: the next slice takes them
    ?assertEqual({[], Ms}, take_members(Ms, Each, Each - 1)),
    %% a whole slice always takes one, however costly
    ?assertEqual({[1], [2]}, take_members([1, 2], Budget, Budget)),
    ?assertEqual({[], []}, take_members([], Each, Budget)),
    ?assertEqual({[1, 2], []}, take_members([1, 2 | x], 1, Budget)),
    ?assertEqual(3 + 2 + ?SEND_WORDS, send_words({a, [b]})),
    ?assertEqual(Budget, send_words(lists:seq(1, Budget))).
piece_entry_test() ->
    L = node(),
    R = alias(),
    ?assertMatch({piece_start, #{ref := R, to := foo, kind := term, size := 3}},
                 entry(piece_start(R, self(), foo, term, 3, <<"a">>), L, L)),
    ?assertEqual({piece, R, 1, <<"b">>}, entry(piece(R, 1, <<"b">>), L, L)),
    ?assertEqual({error, bad_entry}, entry(piece(R, 1, <<"b">>), other@host, L)),
    ?assertEqual({error, bad_entry}, entry(piece(R, 0, <<"b">>), L, L)),
    ?assertEqual({error, bad_entry}, entry(piece(R, 1, [<<"b">>]), L, L)),
    ?assertEqual({error, bad_entry}, entry(piece_start(R, self(), [foo], term, 3, <<"a">>), L, L)),
    ?assertEqual({error, bad_entry}, entry(piece_start(R, self(), foo, other, 3, <<"a">>), L, L)),
    ?assertEqual({error, bad_entry}, entry(piece_start(R, self(), foo, term, 0, <<"a">>), L, L)),
    ?assertEqual({error, bad_entry},
                 entry(piece_start(R, self(), foo, term, 3, <<"a">>), other@host, L)),
    ?assert(supports(2, piece)),
    ?assertNot(supports(1, piece)),
    ?assert(supports(3, piece_path)),
    ?assertNot(supports(2, piece_path)),
    P = fun(Kind, Size) -> entry(piece_start(R, self(), foo, Kind, Size, <<"a">>), L, L) end,
    ?assertMatch({piece_start, #{kind := {path, [2, 1], 5}}}, P({path, [2, 1], 5}, 9)),
    ?assertMatch({piece_start, #{kind := {path, [1], 9}}}, P({path, [1], 9}, 9)),
    [?assertEqual({error, bad_entry}, P(K, 9))
     || K <- [{path, [], 5}, {path, [0], 5}, {path, [1, 2, 3, 4], 5}, {path, [1], 10},
              {path, [1], -1}, {path, [a], 1}, {path, [1 | 2], 1}, {path, 1, 1},
              {path, [1], 1.0}, {other, [1], 1}]],
    %% an acknowledgement interval (version 3); a 4-element start asks for every piece
    ?assert(supports(3, piece_acks)),
    ?assertNot(supports(2, piece_acks)),
    ?assertMatch({piece_start, #{ack_every := 1}},
                 entry(piece_start(R, self(), foo, term, 3, <<"a">>), L, L)),
    A = fun(K) -> entry(piece_start(R, self(), foo, term, 3, K, <<"a">>), L, L) end,
    ?assertMatch({piece_start, #{ack_every := 2, kind := term, size := 3}}, A(2)),
    ?assertMatch({piece_start, #{ack_every := 1024}}, A(1024)),
    [?assertEqual({error, bad_entry}, A(K)) || K <- [0, -1, 1025, 1.0, x]].

negotiate_test() ->
    ?assertEqual(5, negotiate([1, 2, 3, 4, 5, 6])),
    ?assertEqual(4, negotiate([1, 2, 3, 4])),
    ?assertEqual(3, negotiate([1, 2, 3])),
    ?assert(supports(4, zbatch)),
    ?assertNot(supports(3, zbatch)),
    ?assertEqual(2, negotiate([1, 2])),
    ?assertEqual(1, negotiate([1])),
    ?assertEqual(none, negotiate([7])).
-endif.

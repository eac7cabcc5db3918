%% @private
%% The bound on a peer node's partial messages in pieces (`max_reassembly_bytes'),
%% shared by this node's inboxes: the table of each node's shares, and the
%% process that owns it and alone writes it (the arrays in it are
%% `convoy_held''s).
%%
%% A node's messages in pieces reach whichever inbox their senders' lanes use,
%% so every inbox may hold partials of the same node. Per node, a row of the
%% protected table `convoy_reassembly' holds the node's shares
%% (`convoy_held:shares()'): one per inbox, the bytes its partials of that node
%% reserve, written only by that inbox (through this module, in the inbox's
%% process), and the mark of a row being forgotten. This process inserts and
%% deletes the rows; the inboxes read them. It starts before the inboxes and
%% stops after them (`convoy_sup'); if it died, the table would go with it, so
%% its death restarts convoy.
%%
%% Taking room (a start): the inbox decides against the room the other inboxes
%% leave (`room/3'), then claims its new total (`reserve/5'): it keeps the start
%% only if the shares stay within the bound and the row is not being forgotten,
%% else its share is put back and it refuses (`convoy_held:claim_share/5': of
%% two inboxes claiming at once both may refuse, never both keep, and a node's
%% reserved bytes never exceed the bound). A node without a row leaves the whole
%% bound; the first claim asks this process for the row (a call, once per row),
%% later ones read it. Giving room back is one write (`release/3').
%%
%% A restarted inbox holds nothing: it zeroes its share in every row
%% (`join/1'), so what its previous run reserved goes with it.
%%
%% Forgetting a node that is gone (`forget/1', each inbox at the node's
%% nodedown, once it gave back its share: a cast to this process): the row is
%% deleted if no inbox reserves anything in it. This process raises the mark
%% before it reads the shares and lowers it if it keeps the row
%% (`convoy_held:try_close_shares/1'); a claimer reads the mark after its claim,
%% so a row is never deleted under a reservation, and an inbox that reserves
%% bytes in a row always finds it.
%%
%% What an inbox reserves per node is its core's to know (`convoy_inbox_core'):
%% the inbox names its slot (`slot()') and the bytes in every call.
-module(convoy_chunk_bound).
-behaviour(gen_server).

-export([start_link/1, join/1, room/3, reserve/5, release/3, forget/1, reserved/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-export_type([slot/0, bound/0]).

-define(TABLE, convoy_reassembly).

-type bound() :: pos_integer() | infinity.
%% An inbox's slot: its index.
-opaque slot() :: pos_integer().

%% @doc Start the table's owner, for `Inboxes' inboxes.
-spec start_link(pos_integer()) -> {ok, pid()} | {error, term()}.
start_link(Inboxes) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, Inboxes, []).

%% @doc Inbox `Index', (re)started: its slot, reserving nothing.
-spec join(pos_integer()) -> slot().
join(Index) ->
    ok = ets:foldl(fun({_Node, Shares}, ok) -> convoy_held:set_share(Shares, Index, 0) end,
                   ok, ?TABLE),
    Index.

%% @doc The bytes this inbox may reserve for `Node''s partials, its own included:
%% `Bound' less what the other inboxes reserve.
-spec room(slot(), node(), bound()) -> non_neg_integer() | infinity.
room(_Index, _Node, infinity) ->
    infinity;
room(Index, Node, Bound) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] -> max(0, Bound - convoy_held:others_share(Shares, Index));
        [] -> Bound
    end.

%% @doc This inbox's reservation for `Node' becomes `Held' bytes (more than
%% `Old', what it reserves now) if the node's reservations in all inboxes stay
%% within `Bound': true; otherwise false, and nothing changed.
-spec reserve(slot(), node(), non_neg_integer(), non_neg_integer(), bound()) -> boolean().
reserve(Index, Node, Old, Held, Bound) ->
    Shares = case ets:lookup(?TABLE, Node) of
                 [{_, S}] -> S;
                 [] -> gen_server:call(?MODULE, {row, Node}, infinity)
             end,
    convoy_held:claim_share(Shares, Index, Old, Held, Bound).

%% @doc This inbox's reservation for `Node' becomes `Held' bytes, no more than
%% before.
-spec release(slot(), node(), non_neg_integer()) -> ok.
release(Index, Node, Held) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] -> convoy_held:set_share(Shares, Index, Held);
        [] -> ok % it reserves nothing there
    end.

%% @doc `Node' is gone and this inbox gave back its share: the row is deleted if
%% no inbox reserves anything in it.
-spec forget(node()) -> ok.
forget(Node) ->
    gen_server:cast(?MODULE, {forget, Node}).

%% @doc Bytes reserved for `Node''s partial messages in all inboxes (for tests
%% and inspection, from any process).
-spec reserved(node()) -> non_neg_integer().
reserved(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] -> convoy_held:shares(Shares);
        [] -> 0
    end.

%%--------------------------------------------------------------------
%% The table's owner

%% @private
-spec init(pos_integer()) -> {ok, pos_integer()}.
init(Inboxes) ->
    _ = ets:new(?TABLE, [named_table, protected, set, {read_concurrency, true}]),
    {ok, Inboxes}.

%% @private
-spec handle_call(term(), gen_server:from(), pos_integer()) ->
          {reply, convoy_held:shares() | {error, badarg}, pos_integer()}.
handle_call({row, Node}, _From, Inboxes) when is_atom(Node) ->
    %% Another inbox may have asked first.
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] ->
            {reply, Shares, Inboxes};
        [] ->
            Shares = convoy_held:new_shares(Inboxes),
            true = ets:insert(?TABLE, {Node, Shares}),
            {reply, Shares, Inboxes}
    end;
handle_call(_Other, _From, Inboxes) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, badarg}, Inboxes}.

%% @private
-spec handle_cast(term(), pos_integer()) -> {noreply, pos_integer()}.
handle_cast({forget, Node}, Inboxes) when is_atom(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Shares}] ->
            _ = convoy_held:try_close_shares(Shares) andalso ets:delete(?TABLE, Node),
            {noreply, Inboxes};
        [] ->
            {noreply, Inboxes}
    end;
handle_cast(_Other, Inboxes) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, Inboxes}.

%% @private
-spec handle_info(term(), pos_integer()) -> {noreply, pos_integer()}.
handle_info(_Other, Inboxes) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, Inboxes}.
